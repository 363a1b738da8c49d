"""The load step of each `adapter_delivery`, and ReceiverClient's answers, against a real receiver on 127.0.0.1.

The receiver's co-located vLLM, and the trainer's client for shared_fs, are tests/fakes.py's FakeVLLM here: the unit
tier has no vLLM server, and a real one cannot be made to report an adapter served from another path on demand.
tests/integration/test_delivery.py loads into a real one."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from fakes import FakeVLLM
from liveness import returns_within
from peft import LoraConfig

from asyncgrpo.errors import InferenceServerError, ServerUnreachableError, SyncError
from asyncgrpo.inference_node.receiver import AdapterReceiver, serve
from asyncgrpo.rollout.delivery import HttpDelivery, ReceiverClient, SharedFsDelivery
from asyncgrpo.store import AdapterStore

KEY = "delivery-load-key"
VLLM = "http://10.9.9.9:8000"  # the trainer's client for that server is never called with http delivery
CONFIG = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], task_type="CAUSAL_LM")


def version(store: AdapterStore, n: int):
    return store.write(n, {"base_model.model.layer.q_proj.lora_A.weight": torch.full((8, 16), float(n)),
                           "base_model.model.layer.q_proj.lora_B.weight": torch.full((16, 8), float(n))},
                       CONFIG, base_model="/models/base")


class Unreachable:
    """The trainer's client for a server with a receiver: the receiver loads, so it must not be called at all."""

    base_url = VLLM

    def __getattr__(self, name):
        raise AssertionError(f"the trainer's vLLM client was called ({name}); the receiver loads")


def start(rec: AdapterReceiver, api_key: str | None = KEY):
    server = serve(rec, "127.0.0.1", 0, api_key)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture()
def receiver(tmp_path):
    """(receiver, its URL, its vLLM) with a FakeVLLM behind it."""
    vllm = FakeVLLM()
    rec = AdapterReceiver(tmp_path / "server-side", vllm=vllm)
    server, url = start(rec)
    yield rec, url, vllm
    server.shutdown()
    server.server_close()


def test_shared_fs_loads_the_trainers_own_path_and_expects_it_back_resolved(tmp_path):
    real = version(AdapterStore(tmp_path / "store"), 1)
    (tmp_path / "link").symlink_to(real.parent)
    via_link = tmp_path / "link" / real.name
    client, delivery = FakeVLLM(VLLM), SharedFsDelivery()  # the trainer's InferenceClient for shared_fs
    delivery.stage(client, "policy-v1", via_link)
    assert client.calls == []  # nothing to send: the server reads the path itself
    delivery.load(client, "policy-v1", via_link)
    assert client.said() == ["load policy-v1"] and client.served == {"policy-v1": str(via_link)}
    assert delivery.served_path(client, "policy-v1", via_link) == str(real.resolve())  # what vLLM reports


def test_http_load_asks_the_receiver_to_load_its_committed_copy(receiver, tmp_path, caplog):
    rec, url, vllm = receiver
    path = version(AdapterStore(tmp_path / "trainer-side"), 1)
    delivery = HttpDelivery({VLLM: ReceiverClient(url, KEY)})
    delivery.stage(Unreachable(), "policy-v1", path)
    assert vllm.calls == []  # staging only uploads: the load comes inside the pause
    with caplog.at_level("WARNING", logger="asyncgrpo.rollout.delivery"):
        delivery.load(Unreachable(), "policy-v1", path)
    assert vllm.said() == ["read", "load policy-v1", "read"]  # loaded once, then read back
    assert vllm.served == {"policy-v1": str(rec.root / "policy-v1")}
    assert "uploading it again" not in caplog.text  # committed there: loaded at once, not sent twice
    assert delivery.served_path(Unreachable(), "policy-v1", path) == str(rec.root / "policy-v1")
    assert delivery.served_path(Unreachable(), "policy-v2", path) is None  # never staged


def test_make_delivery_gives_each_receiver_the_servers_api_key(receiver, monkeypatch):
    from asyncgrpo.config import API_KEY_ENV, AsyncGRPOConfig
    from asyncgrpo.rollout.delivery import make_delivery

    rec, url, vllm = receiver
    monkeypatch.setenv(API_KEY_ENV, KEY)
    cfg = AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="a", adapter_delivery="http",
                          vllm_server_base_url=VLLM,
                          adapter_receiver_url=url)
    assert make_delivery(cfg).receivers[VLLM].committed() == []  # the receiver requires KEY: a 401 without it


def test_http_load_of_a_version_the_receiver_lost_uploads_it_again_then_loads_it(receiver, tmp_path):
    rec, url, vllm = receiver
    path = version(AdapterStore(tmp_path / "trainer-side"), 1)
    delivery = HttpDelivery({VLLM: ReceiverClient(url, KEY)})
    delivery.stage(Unreachable(), "policy-v1", path)
    shutil.rmtree(rec.root / "policy-v1")  # a replaced node, or a receiver restarted on an empty directory
    delivery.load(Unreachable(), "policy-v1", path)
    remote = rec.root / "policy-v1"
    assert {p.name: p.read_bytes() for p in remote.iterdir()} == {p.name: p.read_bytes() for p in path.iterdir()}
    assert vllm.said() == ["read", "load policy-v1", "read"] and vllm.served == {"policy-v1": str(remote)}


def test_http_load_refuses_a_version_served_from_another_path_than_the_committed_one(receiver, tmp_path):
    rec, url, vllm = receiver
    path = version(AdapterStore(tmp_path / "trainer-side"), 1)
    delivery = HttpDelivery({VLLM: ReceiverClient(url, KEY)})
    delivery.stage(Unreachable(), "policy-v1", path)
    vllm.misreport = "/old/copy/policy-v1"  # a server that kept another copy
    with pytest.raises(SyncError) as info:
        delivery.load(Unreachable(), "policy-v1", path)
    assert str(info.value) == (f"the receiver {url} reports policy-v1 served from '/old/copy/policy-v1', but "
                               f"committed it at {str(rec.root / 'policy-v1')!r}")


def test_http_load_failing_otherwise_than_not_committed_is_raised_without_uploading_again(tmp_path):
    rec = AdapterReceiver(tmp_path / "server-side", vllm=None)  # answers 503 to every load
    server, url = start(rec)
    try:
        path = version(AdapterStore(tmp_path / "trainer-side"), 1)
        delivery = HttpDelivery({VLLM: ReceiverClient(url, KEY)})
        delivery.stage(Unreachable(), "policy-v1", path)
        shutil.rmtree(rec.root / "policy-v1")
        with pytest.raises(InferenceServerError) as info:
            delivery.load(Unreachable(), "policy-v1", path)
        assert info.value.status == 503 and "started without --vllm-url" in str(info.value)
        assert rec.committed() == []  # not uploaded again: only a 404 (not committed there) is
    finally:
        server.shutdown()
        server.server_close()


def test_a_receiver_refusal_names_the_call_the_url_the_status_and_the_receivers_reason(receiver):
    rec, url, vllm = receiver
    client = ReceiverClient(url + "/", KEY)  # a trailing slash in adapter_receiver_url is fine
    assert client.base_url == url
    with pytest.raises(InferenceServerError) as info:
        client.load("policy-v9")
    assert str(info.value) == (f"load policy-v9: POST {url}/adapters/policy-v9/load answered HTTP 404: version "
                               f"policy-v9 is not committed here; upload and commit it first")
    assert info.value.status == 404 and '"error"' in info.value.body  # no API key hint: not a 401
    assert client.committed() == [] and client.health()


def plain_text_server(status: int, body: str):
    """A server answering every GET with `status` and `body` as text/plain: what a proxy in front of a receiver may
    answer (the receiver itself always answers JSON)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Plain(BaseHTTPRequestHandler):
        def do_GET(self):
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_receiver_answer_that_is_not_json_is_quoted_as_text():
    server, url = plain_text_server(502, "upstream proxy said no")
    try:
        with pytest.raises(InferenceServerError) as info:
            ReceiverClient(url, KEY).committed()
        assert str(info.value) == f"list adapters: GET {url}/adapters answered HTTP 502: upstream proxy said no"
        assert info.value.status == 502 and info.value.body == "upstream proxy said no"
    finally:
        server.shutdown()
        server.server_close()


def test_a_success_that_is_not_json_is_refused_quoting_its_first_200_characters():
    body = "<html>" + "x" * 194 + "TAIL beyond the quote</html>"  # characters 200 on are left out of the message
    server, url = plain_text_server(200, body)
    try:
        with pytest.raises(InferenceServerError) as info:
            ReceiverClient(url, KEY).committed()
        assert str(info.value) == (f"list adapters: GET {url}/adapters answered 200 with a body that is not JSON: "
                                   f"{body[:200]!r}")
        assert "TAIL" not in str(info.value) and not isinstance(info.value, ServerUnreachableError)
        assert info.value.status == 200 and info.value.body == body  # the whole answer, for whoever reads the error
    finally:
        server.shutdown()
        server.server_close()


def test_the_receiver_is_called_directly_whatever_proxy_the_environment_names(receiver, monkeypatch):
    rec, url, vllm = receiver
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    client = ReceiverClient(url, KEY)
    assert client.committed() == [] and client.health()


@pytest.mark.parametrize("call", ["committed", "upload", "load"])
def test_a_receiver_that_does_not_answer_in_time_fails_the_call_with_its_url(call, monkeypatch, tmp_path):
    import socket

    from asyncgrpo.rollout import delivery as delivery_module

    listener = socket.socket()  # accepts the connection (the kernel does) but never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setattr(delivery_module, "ADMIN_TIMEOUT_S", 0.2)
    monkeypatch.setattr(delivery_module, "UPLOAD_TIMEOUT_S", 0.2)
    client = ReceiverClient(url, KEY)
    path = version(AdapterStore(tmp_path / "trainer-side"), 1)
    calls = {"committed": client.committed, "upload": lambda: client.upload("policy-v1", path),
             "load": lambda: client.load("policy-v1")}
    first = {"committed": "list adapters: GET /adapters", "upload": "upload adapter_model.safetensors: PUT "
             "/adapters/policy-v1/adapter_model.safetensors", "load": "load policy-v1: POST /adapters/policy-v1/load"}
    try:
        with pytest.raises(InferenceServerError) as info:
            # a liveness bound: a call that passes no read timeout would wait forever on a receiver that never answers
            returns_within(calls[call], 15.0, f"{call}() on a receiver that never answers")
        assert not isinstance(info.value, ServerUnreachableError)  # it answered the connection: not a dead node
        what, method_route = first[call].split(": ")
        method, route = method_route.split(" ")
        assert str(info.value).startswith(f"{what}: {method} {url}{route} failed: ")
    finally:
        listener.close()
