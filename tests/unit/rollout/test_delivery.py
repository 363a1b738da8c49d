"""The trainer's side of `adapter_delivery`: the config keys, and HttpDelivery against a real receiver (HTTP on
127.0.0.1, no vLLM behind it; the loads are in tests/integration/test_delivery.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from peft import LoraConfig

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigError, InferenceServerError, ServerUnreachableError, SyncError
from asyncgrpo.inference_node.receiver import AdapterReceiver, serve
from asyncgrpo.rollout.delivery import HttpDelivery, ReceiverClient, SharedFsDelivery, make_delivery
from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.store import AdapterStore

KEY = "delivery-unit-key"
VLLM = "http://10.9.9.9:8000"  # never contacted: the stage step talks to the receiver only
CONFIG = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], task_type="CAUSAL_LM")


def version(store: AdapterStore, n: int):
    return store.write(n, {"base_model.model.layer.q_proj.lora_A.weight": torch.full((8, 16), float(n)),
                           "base_model.model.layer.q_proj.lora_B.weight": torch.full((16, 8), float(n))},
                       CONFIG, base_model="/models/base")


@pytest.fixture()
def receiver(tmp_path):
    rec = AdapterReceiver(tmp_path / "server-side", vllm=None)
    server = serve(rec, "127.0.0.1", 0, KEY)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield rec, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class Unreachable:
    """Stands in for a vLLM server that must not be called at all (the failure comes before any call to it)."""

    def __init__(self, base_url: str = VLLM):
        self.base_url = base_url

    def __getattr__(self, name):
        raise AssertionError(f"vLLM was called ({name}) although the delivery failed")


def test_http_delivery_needs_one_receiver_per_server():
    with pytest.raises(ConfigError, match="adapter_receiver_url"):
        AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="a", adapter_delivery="http")
    with pytest.raises(ConfigError, match="has 1 entries for 2"):
        AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="a", adapter_delivery="http",
                        vllm_server_base_url=[VLLM, "http://10.9.9.8:8000"],
                        adapter_receiver_url="http://10.9.9.9:8001")
    with pytest.raises(ConfigError, match="adapter_delivery is shared_fs"):
        AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="a", adapter_receiver_url="http://10.9.9.9:8001")
    with pytest.raises(ConfigError, match="unknown value 'nfs'"):
        AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="a", adapter_delivery="nfs")
    cfg = AsyncGRPOConfig.load(None, ["--model_name_or_path", "toy", "--lora_adapter_path", "a",
                                      "--adapter_delivery", "http",
                                      "--vllm_server_base_url", f"{VLLM},http://10.9.9.8:8000",
                                      "--adapter_receiver_url", "http://10.9.9.9:8001,http://10.9.9.8:8001"])
    delivery = make_delivery(cfg)
    assert {url: r.base_url for url, r in delivery.receivers.items()} == {
        VLLM: "http://10.9.9.9:8001", "http://10.9.9.8:8000": "http://10.9.9.8:8001"}
    assert isinstance(make_delivery(AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="a")), SharedFsDelivery)


def test_staging_uploads_the_version_byte_for_byte_and_a_retry_is_idempotent(receiver, tmp_path):
    rec, url = receiver
    path = version(AdapterStore(tmp_path / "trainer-side"), 1)
    delivery = HttpDelivery({VLLM: ReceiverClient(url, KEY)})
    delivery.stage(Unreachable(), "policy-v1", path)
    remote = rec.root / "policy-v1"
    assert delivery.served_path(Unreachable(), "policy-v1", path) == str(remote)
    assert {p.name: p.read_bytes() for p in remote.iterdir()} == {p.name: p.read_bytes() for p in path.iterdir()}
    delivery.stage(Unreachable(), "policy-v1", path)
    assert rec.committed() == ["policy-v1"]


def test_a_refused_upload_fails_the_sync_before_any_server_is_touched(receiver, tmp_path):
    rec, url = receiver
    store = AdapterStore(tmp_path / "trainer-side")
    publisher = AdapterPublisher([Unreachable()], "policy", adapter_root=store.root,
                                 delivery=HttpDelivery({VLLM: ReceiverClient(url, "not-the-key")}))
    with pytest.raises(SyncError) as info:
        publisher.publish(1, version(store, 1))
    message = str(info.value)
    assert "HTTP 401" in message and "ASYNCGRPO_VLLM_API_KEY" in message
    assert message.endswith("\n  No server was asked to load it; the servers still serve no adapter.")
    assert publisher.current_name is None and publisher.loaded == {}
    assert rec.committed() == []


@pytest.fixture()
def two_receivers(tmp_path):
    """Two receivers in this process, each on its own 127.0.0.1 port and directory, as two inference nodes have."""
    made = []
    for i in range(2):
        rec = AdapterReceiver(tmp_path / f"server-side-{i}", vllm=None, max_file_bytes=1 << 20)
        server = serve(rec, "127.0.0.1", 0, KEY)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append((rec, f"http://127.0.0.1:{server.server_address[1]}", server))
    yield [(rec, url) for rec, url, _ in made]
    for _, _, server in made:
        server.shutdown()
        server.server_close()


OVERLAP_DEADLINE_S = 20.0  # both uploads meet within milliseconds when they overlap; sequential ones never meet


def test_staging_uploads_to_every_receiver_at_once(two_receivers, tmp_path):
    (rec_a, url_a), (rec_b, url_b) = two_receivers
    meet = threading.Barrier(2, timeout=OVERLAP_DEADLINE_S)
    for rec in (rec_a, rec_b):  # each receiver's first file waits until the other receiver has one in progress too
        first = threading.Event()

        def put_file(name, filename, length, body, put=rec.put_file, first=first):
            if not first.is_set():
                first.set()
                meet.wait()  # one upload after the other: the first waits alone and the barrier breaks
            return put(name, filename, length, body)

        rec.put_file = put_file
    path = version(AdapterStore(tmp_path / "trainer-side"), 1)
    servers = [Unreachable("http://10.9.9.1:8000"), Unreachable("http://10.9.9.2:8000")]
    delivery = HttpDelivery({servers[0].base_url: ReceiverClient(url_a, KEY),
                             servers[1].base_url: ReceiverClient(url_b, KEY)})
    assert delivery.stage_all(servers, "policy-v1", path) == []
    assert not meet.broken
    local = {p.name: p.read_bytes() for p in path.iterdir()}
    for server, rec in zip(servers, (rec_a, rec_b)):
        remote = rec.root / "policy-v1"
        assert {p.name: p.read_bytes() for p in remote.iterdir()} == local  # every byte, on each node
        assert delivery.served_path(server, "policy-v1", path) == str(remote)  # each node's own copy


def test_one_receiver_refusing_fails_the_publish_with_its_message_and_nothing_is_loaded(two_receivers, tmp_path):
    (rec_a, url_a), (rec_b, url_b) = two_receivers
    rec_b.max_file_bytes = 16  # this node refuses the weights file (413)
    store = AdapterStore(tmp_path / "trainer-side")
    servers = [Unreachable("http://10.9.9.1:8000"), Unreachable("http://10.9.9.2:8000")]  # a load would fail the test
    publisher = AdapterPublisher(servers, "policy", adapter_root=store.root,
                                 delivery=HttpDelivery({servers[0].base_url: ReceiverClient(url_a, KEY),
                                                        servers[1].base_url: ReceiverClient(url_b, KEY)}))
    with pytest.raises(SyncError) as info:
        publisher.publish(1, version(store, 1))
    message = str(info.value)
    assert message.startswith(f"delivering {store.path(1)} to http://10.9.9.2:8000 failed")
    assert "HTTP 413" in message and "--max-file-bytes 16" in message and url_b in message
    assert "http://10.9.9.1:8000 failed" not in message and "No server was asked to load it" in message
    assert publisher.current_name is None and publisher.loaded == {}
    assert rec_b.committed() == []
    assert rec_a.committed() == ["policy-v1"]  # uploaded at the same time, but only stored: nothing serves it


def test_an_unreachable_receiver_is_reported_with_the_command_that_starts_it(tmp_path):
    from asyncgrpo.inference_node.vllm_server import find_free_port

    client = ReceiverClient(f"http://127.0.0.1:{find_free_port()}", KEY)
    with pytest.raises(InferenceServerError) as info:
        client.committed()
    assert "launch/vllm/receiver.sh" in str(info.value) and "adapter_receiver_url" in str(info.value)
    assert isinstance(info.value, ServerUnreachableError)  # the class the publisher's recovery path acts on
    assert not client.health()


def test_the_doctor_adds_a_receiver_line_only_with_http_delivery(receiver):
    from asyncgrpo.inference.checks import ServerContext, check_receiver

    rec, url = receiver
    shared = AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="a")
    assert check_receiver(ServerContext(shared, Unreachable(), "m", delivery=make_delivery(shared))) is None
    cfg = AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path="a", adapter_delivery="http",
                          vllm_server_base_url=VLLM,
                          adapter_receiver_url=url)
    ok = check_receiver(ServerContext(cfg, Unreachable(), "m", delivery=HttpDelivery({VLLM: ReceiverClient(url, KEY)})))
    assert ok.ok is True and url in ok.detail
    bad = check_receiver(ServerContext(cfg, Unreachable(), "m",
                                       delivery=HttpDelivery({VLLM: ReceiverClient(url, "wrong")})))
    assert bad.ok is False and "HTTP 401" in bad.detail and "ASYNCGRPO_VLLM_API_KEY" in bad.fix


@pytest.mark.parametrize("delivery", ["shared_fs", "http"])
def test_an_unreachable_server_skips_the_receiver_line_only_where_there_is_a_receiver(delivery, tmp_path):
    from asyncgrpo.rollout.preflight import _server_results
    from asyncgrpo.inference.checks import ServerContext
    from asyncgrpo.inference.client import InferenceClient
    from asyncgrpo.inference_node.vllm_server import find_free_port

    url = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there: connection refused at once
    cfg = AsyncGRPOConfig(model_name_or_path="toy", lora_adapter_path=str(tmp_path), adapter_delivery=delivery,
                          vllm_server_base_url=url,
                          **({"adapter_receiver_url": "http://127.0.0.1:9"} if delivery == "http" else {}))
    with InferenceClient(url, timeout_s=5) as client:
        results = _server_results(ServerContext(cfg, client, "m", delivery=make_delivery(cfg)))
    assert results[0].ok is False  # not reachable; every other check is skipped, not run
    assert all(r.ok is None for r in results[1:])
    receiver_lines = [r for r in results if r.name == "adapter receiver"]
    assert len(receiver_lines) == (1 if delivery == "http" else 0)


def test_a_receiver_echoing_the_key_across_its_cut_leaves_no_8_characters_of_it(stubs):
    def echo(stub, handler):  # not JSON: the message quotes the first 2,000 characters, the cut 9 into the key
        return 401, "text/plain", "x" * (2000 - len("Bearer ") - 9) + handler.headers["Authorization"]

    stub = stubs(echo)
    with pytest.raises(InferenceServerError) as err:
        ReceiverClient(stub.url, KEY).committed()

    for text in (str(err.value), err.value.body):
        assert "Bearer ***" in text
        assert not [KEY[i:i + 8] for i in range(len(KEY) - 7) if KEY[i:i + 8] in text]
