"""The agent endpoint's HTTP layer with a plain HTTP client (what an agent written without the openai package sends):
its routes, bodies it refuses before serving them, the key, errors as OpenAI's error objects, and episodes coming and
going. No server behind it: a call that reaches an episode is answered by a stand-in."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading

import pytest

from asyncgrpo.rollout import agent_endpoint
from asyncgrpo.rollout.agent_endpoint import AgentEndpoint
from asyncgrpo.rollout.capture import CaptureRefused, Turn

CALL = {"model": "ep", "messages": [{"role": "user", "content": "x"}]}


class Episode:
    """Answers every call with `7`, or raises `fault`; records the requests it served."""

    def __init__(self, name="ep", fault=None):
        self.name, self.fault, self.requests = name, fault, []

    def chat(self, request):
        if self.fault is not None:
            raise self.fault
        self.requests.append(request)
        return Turn({"role": "assistant", "content": "7"}, "stop", prompt_tokens=4, completion_tokens=2)


@pytest.fixture
def endpoint():
    e = AgentEndpoint("127.0.0.1", 0, temperature=1.0, top_p=1.0)
    yield e
    e.close()


def send(endpoint, method, path, body=None, headers=None) -> tuple[int, dict | str, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=10)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers or {})
        answer = conn.getresponse()
        raw = answer.read().decode()
        kind = answer.getheader("Content-Type")
        return answer.status, json.loads(raw) if kind == "application/json" else raw, dict(answer.getheaders())
    finally:
        conn.close()


def test_a_call_is_answered_as_openai_answers_and_a_trailing_slash_is_the_same_route(endpoint):
    episode = Episode()
    endpoint.register(episode)
    status, body, headers = send(endpoint, "POST", "/v1/chat/completions/", CALL)
    assert status == 200 and headers["Content-Type"] == "application/json" and body["model"] == "ep"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "7"}
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert int(headers["Content-Length"]) == len(json.dumps(body).encode())
    assert episode.requests[0].model == "ep" and episode.requests[0].messages == CALL["messages"]


def test_a_streamed_call_is_server_sent_events_ending_in_done(endpoint):
    endpoint.register(Episode())
    status, body, headers = send(endpoint, "POST", "/v1/chat/completions",
                                 {**CALL, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = body.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert {c["model"] for c in chunks} == {"ep"}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "stop"]
    assert chunks[-1]["usage"]["total_tokens"] == 6


def test_other_routes_are_404_naming_the_route(endpoint):
    status, body, _ = send(endpoint, "GET", "/v1/chat/completions")
    assert status == 404 and body["error"]["message"] == "no route GET /v1/chat/completions"
    status, body, _ = send(endpoint, "POST", "/v1/completions", {"model": "ep", "prompt": "x"})
    assert status == 404 and body["error"]["message"].startswith("no route POST /v1/completions: the agent endpoint")
    assert body["error"]["type"] == "invalid_request_error"


def test_models_lists_the_live_episodes_as_they_come_and_go(endpoint):
    a, b = Episode("a"), Episode("b")
    endpoint.register(a)
    endpoint.register(b)
    status, body, _ = send(endpoint, "GET", "/v1/models/")
    assert status == 200 and body == {"object": "list", "data": [
        {"id": "a", "object": "model", "owned_by": "asyncgrpo"}, {"id": "b", "object": "model", "owned_by": "asyncgrpo"}]}
    endpoint.unregister(a)
    endpoint.unregister(a)  # twice: nothing to do
    assert endpoint.names() == ["b"]
    status, body, _ = send(endpoint, "POST", "/v1/chat/completions", {**CALL, "model": "a"})
    assert status == 404 and body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"
    assert body["error"]["message"] == ("the model 'a' is not a live episode: use the `model` your agent function "
                                        "was called with, while that call runs")


def test_a_body_that_is_not_json_or_not_an_object_is_a_400(endpoint):
    endpoint.register(Episode())
    status, body, _ = send(endpoint, "POST", "/v1/chat/completions", b"{not json",
                           {"Content-Type": "application/json"})
    assert status == 400 and body["error"]["message"] == "the request body is not JSON"
    status, body, _ = send(endpoint, "POST", "/v1/chat/completions", b"")
    assert status == 400 and body["error"]["message"] == "the body must be a JSON object"


def test_a_body_over_the_limit_is_refused_before_it_is_read(endpoint, monkeypatch):
    monkeypatch.setattr(agent_endpoint, "MAX_BODY_BYTES", 100)
    episode = Episode()
    endpoint.register(episode)
    small = {**CALL, "user": "u" * (100 - len(json.dumps({**CALL, "user": ""})))}
    assert len(json.dumps(small)) == 100 and send(endpoint, "POST", "/v1/chat/completions", small)[0] == 200  # at it
    status, body, headers = send(endpoint, "POST", "/v1/chat/completions", {**CALL, "user": "u" * 100})
    assert status == 413 and "over 100" in body["error"]["message"] and len(episode.requests) == 1


def test_a_refused_body_closes_the_connection_so_its_unread_bytes_are_never_taken_for_a_request(endpoint,
                                                                                               monkeypatch):
    monkeypatch.setattr(agent_endpoint, "MAX_BODY_BYTES", 100)
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        answer = http.client.HTTPResponse(s)
        answer.begin()
        assert answer.status == 413 and b"over 100" in answer.read()
        assert s.recv(1) == b""  # closed by the server; kept open, the server would wait for a next request here


def test_a_post_without_content_length_is_an_empty_body_not_a_wait_for_one(endpoint):
    endpoint.register(Episode())
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = http.client.HTTPResponse(s)
        answer.begin()
        assert answer.status == 400
        assert json.loads(answer.read())["error"]["message"] == "the body must be a JSON object"


def test_a_refusal_keeps_its_status_and_a_fault_in_the_endpoint_is_a_500_naming_it(endpoint, caplog):
    endpoint.register(Episode("gone", fault=CaptureRefused(410, "lost", code="episode_lost")))
    endpoint.register(Episode("bug", fault=KeyError("oops")))
    status, body, _ = send(endpoint, "POST", "/v1/chat/completions", {**CALL, "model": "gone"})
    assert status == 410 and body["error"] == {"message": "lost", "type": "invalid_request_error", "param": None,
                                               "code": "episode_lost"}
    status, body, _ = send(endpoint, "POST", "/v1/chat/completions", {**CALL, "model": "bug"})
    assert status == 500 and body["error"]["message"] == "KeyError: 'oops'" and body["error"]["type"] == "server_error"
    logged = [r for r in caplog.records if r.name == agent_endpoint.__name__ and r.levelno == logging.ERROR]
    assert [(r.getMessage(), r.exc_info[0]) for r in logged] == [("agent endpoint: a call failed", KeyError)]


def test_a_keyed_endpoint_wants_the_bearer_key_on_every_route():
    keyed = AgentEndpoint("127.0.0.1", 0, temperature=1.0, top_p=1.0, key="s3cret")
    try:
        keyed.register(Episode())
        for headers in ({}, {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cre"}):
            status, body, _ = send(keyed, "GET", "/v1/models", headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert body["error"]["message"] == ("missing or wrong API key: send the key in ASYNCGRPO_AGENT_KEY as "
                                                "the client's api_key")
            assert send(keyed, "POST", "/v1/chat/completions", CALL, headers=headers)[0] == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert send(keyed, "GET", "/v1/models", headers=ok)[0] == 200
        assert send(keyed, "POST", "/v1/chat/completions", CALL, headers=ok)[0] == 200
    finally:
        keyed.close()


def test_an_ipv6_host_gets_brackets_in_the_base_url():
    try:  # asked of a plain socket: an endpoint failing to bind ::1 is what this test is for
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:  # a host without IPv6 loopback
        pytest.skip(f"no ::1 here: {exc}")
    e = AgentEndpoint("::1", 0, temperature=1.0, top_p=1.0)
    try:
        assert e.base_url == f"http://[::1]:{e.port}/v1"
        conn = http.client.HTTPConnection("::1", e.port, timeout=10)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        e.close()


def test_the_base_url_names_the_host_and_the_port_it_listens_on(endpoint):
    assert endpoint.base_url == f"http://127.0.0.1:{endpoint.port}/v1" and endpoint.port > 0
    assert endpoint.temperature == 1.0 and endpoint.top_p == 1.0 and endpoint.key is None


def test_the_server_runs_on_a_thread_named_for_it_that_cannot_keep_the_process_alive():
    before = set(threading.enumerate())
    e = AgentEndpoint("127.0.0.1", 0, temperature=1.0, top_p=1.0)
    try:
        started = set(threading.enumerate()) - before
        assert [(t.name, t.daemon) for t in started] == [("agent-endpoint", True)]  # named in stack dumps
    finally:
        e.close()
