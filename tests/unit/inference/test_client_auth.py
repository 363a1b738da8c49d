"""The API key goes with EVERY request the client makes, including the routes vLLM itself does not check.

A real vLLM server with `--api-key` checks the key only on `/v1/*`, so it cannot show whether `/pause`, `/resume`,
`/reset_prefix_cache` or `/health` got the header: an in-process HTTP stub that records each request's headers
stands in for it (the stub server of conftest.py, on 127.0.0.1). A real server started with a key is exercised by
tests/integration/test_security.py.
"""

from __future__ import annotations

import json
import threading

import pytest

from asyncgrpo.inference.client import InferenceClient

API_KEY = "sk-auth-test-4b1d-never-logged"
ADAPTER = {"id": "policy-v1", "root": "/adapters/v1", "parent": "base"}
ANSWERS = {  # path -> JSON body; anything else answers 200 "Success" in plain text, as vLLM's adapter routes do
    "/health": "",
    "/version": {"version": "0.32.0"},
    "/v1/models": {"data": [{"id": "base", "root": "/models/base", "parent": None}, ADAPTER]},
    "/server_info": {"vllm_config": {"lora_config": {"max_lora_rank": 8, "max_loras": 4}}},
    "/v1/completions": {"model": "policy-v1", "choices": [
        {"index": 0, "text": "7", "token_ids": [10], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop",
         "prompt_logprobs": [None, {"5": {"logprob": -1.0}}]}]},
    "/pause": {"status": "paused"},
    "/is_paused": {"is_paused": False},
    "/reset_prefix_cache": {"success": True},
}


def answer(stub, handler):
    """Every route answers 200: a JSON body from ANSWERS, or vLLM's plain-text "Success"."""
    body = ANSWERS.get(handler.path.split("?")[0], "Success")
    if isinstance(body, str):
        return 200, "text/plain", body
    return 200, "application/json", json.dumps(body)


@pytest.fixture
def recorder(stubs):
    """(url, seen): `seen()` lists (path, Authorization header) of every request the stub got so far."""
    stub = stubs(answer)
    return stub.url, lambda: [(r["path"].split("?")[0], r["headers"].get("Authorization")) for r in stub.requests]


def test_every_call_sends_the_bearer_token(recorder):
    url, seen = recorder
    with InferenceClient(url, api_key=API_KEY) as client:
        assert client.health()
        client.wait_healthy(5)
        assert client.version() == "0.32.0"
        assert client.base_model() == "base"
        assert client.adapter_paths() == {"policy-v1": "/adapters/v1"}
        assert client.server_config()["lora_config"]["max_lora_rank"] == 8
        assert client.has_route("POST", "/v1/load_lora_adapter")
        assert client.complete("policy-v1", [5, 6], n=1, max_tokens=1)[0].token_ids == [10]
        assert client.score("policy-v1", [4, 5]) == [None, -1.0]
        client.load_adapter("policy-v2", "/adapters/v2")
        client.pause("keep")
        assert client.reset_prefix_cache()
        assert not client.is_paused()
        client.resume()
        client.unload_adapter("policy-v1")
        # a request from another thread gets its own session: it must carry the key too
        worker = threading.Thread(target=client.models)
        worker.start()
        worker.join()

    paths = {path for path, _ in seen()}
    assert paths >= {"/health", "/version", "/v1/models", "/server_info", "/v1/load_lora_adapter",
                     "/v1/completions", "/pause", "/resume", "/is_paused", "/reset_prefix_cache",
                     "/v1/unload_lora_adapter"}
    missing = [path for path, header in seen() if header != f"Bearer {API_KEY}"]
    assert missing == []


def test_no_key_sends_no_authorization_header(recorder):
    url, seen = recorder
    with InferenceClient(url) as client:
        client.models()
        client.pause("keep")
    assert [header for _, header in seen()] == [None, None]
