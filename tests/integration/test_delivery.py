"""`adapter_delivery: http` end to end against the real vLLM CPU server and a real receiver process beside it: the
trainer's adapter directory and the receiver's are different, and the server only ever loads the receiver's copy.

We run as root here, so file permissions cannot make the trainer's directory unreadable to the server; the proof
that the server never reads it is that every path it serves (`GET /v1/models`, read after every sync) lies under
the receiver's directory, and that PEFT on the trainer's own files reproduces the server's logprobs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from asyncgrpo.config import API_KEY_ENV, AsyncGRPOConfig
from asyncgrpo.demo import default_config_path
from asyncgrpo.errors import InferenceServerError, SyncError
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import find_free_port
from asyncgrpo.rollout.delivery import HttpDelivery, ReceiverClient
from asyncgrpo.rollout.publish import AdapterPublisher
from asyncgrpo.store import MANIFEST_NAME, AdapterStore

KEY = "delivery-test-key"
PROMPT = [3 + b for b in b"42,24>"]
START_TIMEOUT_S = 60.0  # the receiver imports requests and yaml only: ~1 s; generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def receiver(vllm_server, tmp_path_factory):
    """A receiver process beside the session's vLLM server, with its own directory and the API key."""
    directory = tmp_path_factory.mktemp("receiver") / "adapters"
    port = find_free_port()
    log = open(directory.parent / "receiver.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo.inference_node.receiver", "--dir", str(directory),
                             "--host", "127.0.0.1", "--port", str(port), "--vllm-url", vllm_server.base_url],
                            env={**os.environ, API_KEY_ENV: KEY}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ReceiverClient(url, KEY).health():
        assert proc.poll() is None, (directory.parent / "receiver.log").read_text()
        assert time.monotonic() < deadline, "the receiver did not answer /health"
        time.sleep(0.1)
    yield url, directory.resolve()
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _served_under(client, prefix: str) -> dict[str, str]:
    return {n: p for n, p in client.adapter_paths().items() if n.startswith(prefix)}


def test_training_with_http_delivery_serves_only_the_receivers_copies_and_reproduces_peft(
        vllm_server, receiver, tmp_path, monkeypatch, peft_logprobs):
    from asyncgrpo.trainer.recipe import GRPORecipe

    receiver_url, receiver_dir = receiver
    monkeypatch.setenv(API_KEY_ENV, KEY)
    trainer_dir = tmp_path / "trainer-adapters"
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--max_steps", "3", "--per_device_train_batch_size", "16", "--learning_rate", "1e-2",
        "--sync_mode", "pause", "--output_dir", str(tmp_path / "run"), "--lora_adapter_path", str(trainer_dir),
        "--vllm_server_base_url", vllm_server.base_url,
        "--adapter_delivery", "http", "--adapter_receiver_url", receiver_url])
    trainer = GRPORecipe(cfg)
    served_after_sync = []
    try:
        trainer.setup()
        parts = trainer.rollout.parts
        publish = parts.publisher.publish
        pauses = []
        pause = parts.clients[0].pause
        monkeypatch.setattr(parts.clients[0], "pause", lambda *a, **k: pauses.append(1) or pause(*a, **k))

        def publish_and_read_back(version, path, probe=None):
            timing = publish(version, path, probe)
            served_after_sync.append(_served_under(parts.clients[0], parts.publisher.prefix))
            return timing

        parts.publisher.publish = publish_and_read_back
        trainer.train()
    finally:
        trainer.cleanup()
    assert len(pauses) >= 2  # versions 2 and 3 went live through pause -> load -> resume (the first needs none)
    assert len(served_after_sync) == 3
    for served in served_after_sync:
        assert served and all(Path(p).parent == receiver_dir for p in served.values()), served
    final = trainer.rollout.parts.publisher.current_name  # keep_final_adapter: still loaded after the run
    assert final == f"{trainer.rollout.parts.publisher.prefix}-v3"
    client = InferenceClient(vllm_server.base_url)
    assert client.adapter_paths()[final] == str(receiver_dir / final)
    local = trainer.rollout.parts.store.path(3)
    assert (receiver_dir / final / "adapter_model.safetensors").read_bytes() == \
        (local / "adapter_model.safetensors").read_bytes()
    # PEFT on the base, with the trainer's own files, reproduces what the server computes from the receiver's copy.
    completion = client.complete(final, PROMPT, n=1, max_tokens=12, temperature=1.0)[0]
    served = client.score(final, PROMPT + completion.token_ids)[len(PROMPT):]
    reference = peft_logprobs(local, PROMPT, completion.token_ids)
    diff = max(abs(a - float(b)) for a, b in zip(served, reference))
    # The adapter is in use: it moves the logprobs. Read over the whole sequence, prompt included: a sampled
    # completion can be one or two tokens the model is sure of either way (8.7e-4 over those once, 0.35 usually).
    whole = PROMPT + completion.token_ids
    with_adapter, base = client.score(final, whole)[1:], client.score(client.base_model(), whole)[1:]
    moved = max(abs(a - b) for a, b in zip(with_adapter, base))
    print(json.dumps({"delivery": "http", "sync_mode": "pause", "max_abs_logprob_diff": diff,
                      "max_abs_logprob_diff_vs_base": moved}))
    assert diff < 1e-3 and moved > 1e-3
    client.unload_adapter(final)


def test_versioned_sync_and_a_restarted_server_go_through_the_receiver(
        world, vllm_server, receiver, tmp_path, random_adapter, peft_logprobs):
    receiver_url, receiver_dir = receiver
    client = InferenceClient(vllm_server.base_url)
    store = AdapterStore(tmp_path / "trainer-adapters")
    delivery = HttpDelivery({client.base_url: ReceiverClient(receiver_url, KEY)})
    publisher = AdapterPublisher([client], f"vers-{uuid.uuid4().hex[:6]}", sync_mode="versioned",
                                 adapter_root=store.root, delivery=delivery)
    calls = []
    client.pause = lambda *a, **k: calls.append("pause")  # versioned mode must never pause
    v1 = store.write(1, *random_adapter(seed=3), base_model=str(world.model_dir))
    v2 = store.write(2, *random_adapter(seed=4), base_model=str(world.model_dir))
    publisher.publish(1, v1)
    publisher.publish(2, v2)
    assert calls == []
    served = _served_under(client, publisher.prefix)
    assert served == {publisher.name(1): str(receiver_dir / publisher.name(1)),
                      publisher.name(2): str(receiver_dir / publisher.name(2))}  # both live: versioned
    completion = client.complete(publisher.name(2), PROMPT, n=1, max_tokens=12)[0]
    logprobs = client.score(publisher.name(2), PROMPT + completion.token_ids)[len(PROMPT):]
    reference = peft_logprobs(v2, PROMPT, completion.token_ids)
    base = client.score(client.base_model(), PROMPT + completion.token_ids)[len(PROMPT):]
    assert max(abs(a - float(b)) for a, b in zip(logprobs, reference)) < 1e-3
    assert max(abs(a - b) for a, b in zip(logprobs, base)) > 1e-2  # a random adapter of std 0.3 moves them

    # A restarted server knows no adapters, and a replaced node has lost the receiver's copy too: restore() uploads
    # it again and the server serves the receiver's new copy. (A real restart is tests/integration/test_faults.py's;
    # here the two losses are made by hand, which is what the restore path sees.)
    for name in served:
        client.unload_adapter(name)
    shutil.rmtree(receiver_dir / publisher.name(2))
    publisher.restore(client)
    assert _served_under(client, publisher.prefix) == {publisher.name(2): str(receiver_dir / publisher.name(2))}
    assert json.loads((receiver_dir / publisher.name(2) / MANIFEST_NAME).read_text()) == \
        json.loads((v2 / MANIFEST_NAME).read_text())
    publisher.restore(client)  # once more: already served, nothing is sent or loaded again
    assert _served_under(client, publisher.prefix) == {publisher.name(2): str(receiver_dir / publisher.name(2))}
    client.unload_adapter(publisher.name(2))


def test_a_corrupted_upload_is_rejected_and_nothing_is_loaded(world, vllm_server, receiver, tmp_path, random_adapter):
    receiver_url, receiver_dir = receiver
    client = InferenceClient(vllm_server.base_url)
    good = AdapterStore(tmp_path).write(1, *random_adapter(seed=5), base_model=str(world.model_dir))
    manifest = json.loads((good / MANIFEST_NAME).read_text())
    name = f"corrupt-{uuid.uuid4().hex[:6]}"
    session = requests.Session()
    session.trust_env = False
    session.headers["Authorization"] = f"Bearer {KEY}"
    for filename in manifest:
        data = bytearray((good / filename).read_bytes())
        if filename == "adapter_model.safetensors":
            data[-1] ^= 0xFF  # one flipped bit in the weights: same size, other sha256
        assert session.put(f"{receiver_url}/adapters/{name}/{filename}", data=bytes(data)).status_code == 200
    resp = session.post(f"{receiver_url}/adapters/{name}/commit", json=manifest)
    assert resp.status_code == 422 and "adapter_model.safetensors" in resp.json()["error"]
    assert sorted(p.name for p in receiver_dir.iterdir() if name in p.name) == []  # nothing written, not staged
    load = session.post(f"{receiver_url}/adapters/{name}/load")
    assert load.status_code == 404
    assert name not in client.adapter_paths()
    with pytest.raises(InferenceServerError) as info:  # the trainer's client reports it the same way
        ReceiverClient(receiver_url, KEY).load(name)
    assert info.value.status == 404


def test_doctor_checks_the_receiver_and_loads_its_probe_through_it(vllm_server, receiver, tmp_path, monkeypatch):
    from asyncgrpo.data import resolve_model_path
    from asyncgrpo.rollout.preflight import run_checks

    receiver_url, receiver_dir = receiver
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--lora_adapter_path", str(tmp_path / "trainer-adapters"), "--vllm_server_base_url", vllm_server.base_url,
        "--adapter_delivery", "http", "--adapter_receiver_url", receiver_url])
    model_path = resolve_model_path(cfg)

    def results(key: str) -> dict[str, object]:
        monkeypatch.setenv(API_KEY_ENV, key)
        client = InferenceClient(vllm_server.base_url, api_key=key, connect_retries=0)
        return {r.name: r for where, r in run_checks(cfg, [client], model_path) if where == vllm_server.base_url}

    good = results(KEY)
    assert good["adapter receiver"].ok is True
    probe = good["adapter readable by server"]
    assert probe.ok is True and f"uploaded to {receiver_dir}/asyncgrpo-doctor-" in probe.detail
    assert not any(n.startswith("asyncgrpo-doctor-") for n in InferenceClient(vllm_server.base_url).adapter_paths())
    bad = results("wrong-key")  # vLLM has no key here; the receiver refuses this one
    assert bad["adapter receiver"].ok is False and "HTTP 401" in bad["adapter receiver"].detail
    assert bad["adapter readable by server"].ok is False


def test_a_really_restarted_server_gets_the_current_version_back_from_the_receivers_copy(
        world, tmp_path, random_adapter, peft_logprobs):
    """A vLLM of this test's own, killed and started again on its port (what recovery.py calls `restore` for): the
    receiver beside it kept its copy, so the version is loaded again from there without a second upload."""
    from integration.runs import make_server

    server = make_server(world.model_dir, find_free_port(), max_lora_rank=8, max_loras=4, max_model_len=256,
                         log_path=tmp_path / "vllm.log")
    receiver_dir = (tmp_path / "receiver").resolve()
    port = find_free_port()
    proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo.inference_node.receiver", "--dir", str(receiver_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--vllm-url", server.base_url],
                            env={**os.environ, API_KEY_ENV: KEY}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        server.start()
        server.wait_ready(600)  # minutes on a loaded 2-core machine
        client = InferenceClient(server.base_url)
        store = AdapterStore(tmp_path / "trainer-adapters")
        publisher = AdapterPublisher([client], "restart", sync_mode="pause", adapter_root=store.root,
                                     delivery=HttpDelivery({client.base_url: ReceiverClient(f"http://127.0.0.1:{port}",
                                                                                            KEY)}))
        publisher.publish(1, store.write(1, *random_adapter(seed=11), base_model=str(world.model_dir)))
        v2 = store.write(2, *random_adapter(seed=12), base_model=str(world.model_dir))
        publisher.publish(2, v2)  # paused: a current version exists
        copy = receiver_dir / publisher.name(2) / "adapter_model.safetensors"
        written = copy.stat().st_mtime_ns
        server.stop()
        server.start()
        server.wait_ready(600)
        assert client.adapter_paths() == {}  # a restarted vLLM knows no adapters
        publisher.restore(client)
        assert client.adapter_paths() == {publisher.name(2): str(receiver_dir / publisher.name(2))}
        assert copy.stat().st_mtime_ns == written  # the receiver's copy was reused, not sent or written again
        completion = client.complete(publisher.name(2), PROMPT, n=1, max_tokens=12)[0]
        served = client.score(publisher.name(2), PROMPT + completion.token_ids)[len(PROMPT):]
        reference = peft_logprobs(v2, PROMPT, completion.token_ids)
        assert max(abs(a - float(b)) for a, b in zip(served, reference)) < 1e-3
    finally:
        server.stop()
        proc.terminate()
        proc.wait(timeout=30)


def _start_receiver(directory: Path, port: int, log: Path) -> subprocess.Popen:
    """A receiver process on `port` (its vLLM URL leads nowhere: staging never calls vLLM), polled until healthy."""
    proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo.inference_node.receiver", "--dir", str(directory),
                             "--port", str(port), "--vllm-url", f"http://127.0.0.1:{find_free_port()}"],
                            env={**os.environ, API_KEY_ENV: KEY}, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ReceiverClient(f"http://127.0.0.1:{port}", KEY).health():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc


def test_a_receiver_restarted_during_a_delivery_is_waited_for_and_gets_the_version(world, tmp_path, random_adapter):
    """Found by `bench chaos`: a receiver killed and restarted on its node while a sync delivered to it ended the run,
    because its outage was handed to the vLLM server's recovery, which found the server up and retried at once. The
    delivery now waits for the receiver itself (up to vllm_server_timeout). The restart is started by the delivery's
    own "stopped answering" line, so the call is known to have met the dead receiver."""
    import logging
    from types import SimpleNamespace

    port, directory, log = find_free_port(), tmp_path / "receiver", tmp_path / "receiver.log"
    dead = _start_receiver(directory, port, log)
    dead.kill()  # SIGKILL, as a crashed node
    dead.wait()
    started: list[subprocess.Popen] = []

    class RestartOnOutage(logging.Handler):
        def emit(self, record):
            if "stopped answering" in record.getMessage() and not started:
                started.append(_start_receiver(directory, port, log))

    url = f"http://127.0.0.1:{port}"
    handler, logger = RestartOnOutage(), logging.getLogger("asyncgrpo.rollout.delivery")
    logger.addHandler(handler)
    messages: list[str] = []
    collect = logging.Handler()
    collect.emit = lambda record: messages.append(record.getMessage())
    logger.addHandler(collect)
    path = AdapterStore(tmp_path / "trainer").write(1, *random_adapter(seed=3), base_model=str(world.model_dir))
    server = SimpleNamespace(base_url="http://127.0.0.1:1")  # the vLLM server the receiver stands beside
    try:
        HttpDelivery({server.base_url: ReceiverClient(url, KEY)}, outage_s=60).stage(server, "chaos-v1", path)
        assert started, "the delivery never met the dead receiver"
        assert ReceiverClient(url, KEY).committed() == ["chaos-v1"]
        assert (directory / "chaos-v1" / "adapter_model.safetensors").read_bytes() == \
            (path / "adapter_model.safetensors").read_bytes()
        assert [m.split(" (")[0] for m in messages if "stopped answering" in m] == [
            f"adapter receiver {url} stopped answering"]  # once, not once per retry
        assert any(m.startswith(f"adapter receiver {url} is back after ") for m in messages), messages
        # One that never comes back ends the sync within the budget, naming the receiver and the fix.
        started[0].kill()
        started[0].wait()
        with pytest.raises(SyncError, match=rf"the adapter receiver at {url} stopped answering and did not come back "
                                            rf"within 1 s \(vllm_server_timeout\)\. Fix: restart it"):
            HttpDelivery({server.base_url: ReceiverClient(url, KEY)}, outage_s=1).stage(server, "chaos-v2", path)
    finally:
        logger.removeHandler(handler)
        logger.removeHandler(collect)
        for proc in started:
            proc.kill()
            proc.wait()
