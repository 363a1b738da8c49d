"""InferenceClient's handling of failures a real vLLM server cannot be made to produce on demand.

An in-process HTTP stub (http.server on 127.0.0.1, an ephemeral port, in a thread) stands in for the server only
here: a server that is down or comes up late, a 500 with a plain-text body, 503 answers, a connection dropped
mid-request, and a server that echoes the bearer token. Everything a real server does (adapter load/unload,
pause/resume, completions) is checked by the integration tests against a real vLLM CPU server.
Backoff sleeps are replaced by a recorder, so no test waits.
"""

from __future__ import annotations

import base64
import logging
import socket
from collections.abc import Callable

import pytest

from asyncgrpo.errors import AdapterNotLoadedError, InferenceServerError
from asyncgrpo.inference import client as client_module
from asyncgrpo.inference.client import InferenceClient

API_KEY = "sk-test-7f3a9c-do-not-leak"

@pytest.fixture
def sleeps(monkeypatch):
    """Record the client's backoff delays instead of sleeping; `sleeps.hook` runs on each one."""

    class Recorder(list):
        hook: Callable[[int], None] = staticmethod(lambda n: None)

    recorder = Recorder()

    def fake_sleep(seconds: float) -> None:
        recorder.append(seconds)
        recorder.hook(len(recorder))

    monkeypatch.setattr(client_module.time, "sleep", fake_sleep)
    return recorder


def closed_port() -> int:
    """A port with nothing listening on it: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def count_attempts(client: InferenceClient) -> list[str]:
    """Wrap the client's session so that every HTTP attempt, answered or not, is recorded."""
    attempts: list[str] = []
    send = client._session.request

    def counting(method, url, **kwargs):
        attempts.append(url)
        return send(method, url, **kwargs)

    client._session.request = counting
    return attempts


MODELS_JSON = '{"object": "list", "data": [{"id": "base", "root": "/m/base", "parent": null}]}'


def test_unreachable_server_is_retried_with_backoff_then_named_with_the_fix(sleeps):
    port = closed_port()
    client = InferenceClient(f"http://127.0.0.1:{port}", connect_retries=3, backoff_s=0.5)
    attempts = count_attempts(client)

    with pytest.raises(InferenceServerError) as err:
        client.models()

    assert len(attempts) == 4  # the first try + connect_retries
    assert sleeps == [0.5, 1.0, 2.0]  # exponential backoff between the attempts
    message = str(err.value)
    assert f"http://127.0.0.1:{port}/v1/models" in message
    assert "after 4 attempts" in message and "Connection refused" in message
    assert "python -m asyncgrpo.inference_node.vllm_server" in message and "vllm_server_base_url" in message
    assert err.value.status is None


def test_server_that_comes_up_late_is_reached_by_retrying(stubs, sleeps):
    port = closed_port()
    late: list = []  # the stub server, once started
    sleeps.hook = lambda n: n == 2 and late.append(stubs(lambda s, h: (200, "application/json", MODELS_JSON), port))
    client = InferenceClient(f"http://127.0.0.1:{port}", connect_retries=5, backoff_s=0.01)
    attempts = count_attempts(client)

    assert client.base_model() == "base"
    assert len(attempts) == 3  # refused, refused, answered
    assert len(late[0].requests) == 1  # the server saw only the attempt made after it came up


def test_wait_healthy_names_the_url_and_the_fix_at_the_deadline():
    port = closed_port()
    with pytest.raises(InferenceServerError, match=rf"127\.0\.0\.1:{port}/health.*vllm_server_base_url"):
        InferenceClient(f"http://127.0.0.1:{port}").wait_healthy(timeout_s=0.0)


def test_http_500_plain_text_body_is_quoted_verbatim_and_not_retried(stubs, sleeps):
    body = "Loading lora policy-v3 failed: safetensors_rust.SafetensorError: incomplete metadata\nfile truncated"
    stub = stubs(lambda s, h: (500, "text/plain; charset=utf-8", body))
    client = InferenceClient(stub.url)

    with pytest.raises(InferenceServerError) as err:
        client.load_adapter("policy-v3", "/adapters/v3", inplace=True)

    message = str(err.value)
    assert body in message
    assert message.startswith(f"load_adapter: POST {stub.url}/v1/load_lora_adapter answered HTTP 500")
    assert err.value.status == 500 and err.value.body == body
    assert len(stub.requests) == 1 and sleeps == []


def test_json_error_body_is_quoted_verbatim(stubs):
    body = '{"error":{"message":"The model `policy-v9` does not exist.","type":"NotFoundError","code":404}}'
    stub = stubs(lambda s, h: (404, "application/json", body))

    with pytest.raises(InferenceServerError) as err:
        InferenceClient(stub.url).complete("policy-v9", [1, 2, 3], n=2, max_tokens=4)

    assert body in str(err.value) and err.value.status == 404 and err.value.body == body
    assert isinstance(err.value, AdapterNotLoadedError)  # the model asked for is the one it says does not exist


def test_only_a_404_naming_the_requested_model_is_an_adapter_not_loaded(stubs):
    """Another model's name, or a 404 without that text (a route missing), stays a plain InferenceServerError: the
    producer would take those for a server restart and recover instead of failing."""
    other = '{"error":{"message":"The model `policy-v8` does not exist.","type":"NotFoundError","code":404}}'
    for status, body in [(404, other), (404, '{"detail":"Not Found"}'), (400, other.replace("v8", "v9"))]:
        stub = stubs(lambda s, h, status=status, body=body: (status, "application/json", body))
        with pytest.raises(InferenceServerError) as err:
            InferenceClient(stub.url).complete("policy-v9", [1, 2, 3], n=2, max_tokens=4)
        assert not isinstance(err.value, AdapterNotLoadedError), (status, body)
        assert err.value.status == status


def test_503_is_retried_until_the_server_answers(stubs, sleeps):
    def route(stub, handler):
        if len(stub.requests) <= 2:
            return 503, "application/json", '{"error": "scaling"}'
        return 200, "application/json", '{"is_paused": true}'

    stub = stubs(route)
    assert InferenceClient(stub.url, backoff_s=0.25).is_paused() is True
    assert len(stub.requests) == 3 and sleeps == [0.25, 0.5]


def test_connection_dropped_mid_request_is_not_retried_when_the_call_is_not_idempotent(stubs, sleeps):
    stub = stubs(lambda s, h: None)

    with pytest.raises(InferenceServerError, match="may or may not have applied it") as err:
        InferenceClient(stub.url).unload_adapter("policy-v1")

    assert len(stub.requests) == 1 and sleeps == []
    assert f"{stub.url}/v1/unload_lora_adapter" in str(err.value)


def test_api_key_is_sent_as_bearer_and_never_appears_in_errors_or_logs(stubs, sleeps, caplog):
    def echo_authorization(stub, handler):  # a server that quotes the header back in its error
        return 401, "application/json", f'{{"error": "bad token {handler.headers["Authorization"]}"}}'

    stub = stubs(echo_authorization)
    client = InferenceClient(stub.url, api_key=API_KEY)
    caplog.set_level(logging.DEBUG)

    with pytest.raises(InferenceServerError) as err:
        client.pause("keep")
    assert stub.requests[0]["headers"]["Authorization"] == f"Bearer {API_KEY}"
    assert stub.requests[0]["path"] == "/pause?mode=keep"
    assert "401" in str(err.value) and "API key" in str(err.value)
    assert API_KEY not in str(err.value) and API_KEY not in (err.value.body or "")

    down = InferenceClient(f"http://127.0.0.1:{closed_port()}", api_key=API_KEY, connect_retries=2)
    with pytest.raises(InferenceServerError) as err:
        down.resume()
    assert API_KEY not in str(err.value)
    retries = [r for r in caplog.records if r.name == client_module.__name__]
    assert len(retries) == 2 and f"127.0.0.1:{down.base_url.rsplit(':', 1)[1]}" in retries[0].getMessage()
    assert all(API_KEY not in r.getMessage() for r in caplog.records)
    assert API_KEY not in repr(client)


def test_a_key_echoed_across_the_quote_cut_or_in_base64_leaves_no_8_characters_of_it(stubs, sleeps):
    def echo_cut_and_encoded(stub, handler):  # the cut of the quote falls 13 characters into the key
        header = handler.headers["Authorization"]  # "Bearer <key>"
        filler = "x" * (client_module.MAX_QUOTED_CHARS - len("Bearer ") - 13)
        return 401, "text/plain", f"{filler}{header} debug={base64.b64encode(header.encode()).decode()}"

    stub = stubs(echo_cut_and_encoded)
    with pytest.raises(InferenceServerError) as err:
        InferenceClient(stub.url, api_key=API_KEY).pause("keep")

    encoded = base64.b64encode(f"Bearer {API_KEY}".encode()).decode()
    for text in (str(err.value), err.value.body):
        assert "Bearer ***" in text
        assert not [API_KEY[i:i + 8] for i in range(len(API_KEY) - 7) if API_KEY[i:i + 8] in text]
        assert encoded[12:24] not in text  # the middle of the base64 echo, which spells key bytes only
