"""Inference-node faults and `asyncgrpo doctor`, against real vLLM servers.

The fault tests kill a server of their own (SIGKILL to its process group, as a crashed node), never the session
one. That server is started without dev mode (VLLM_SERVER_DEV_MODE=0) and with raw logprobs (vLLM's default), so it
doubles as the misconfigured server for doctor: `sync_mode: pause` needs dev mode, `versioned` does not (the training
runs here use `versioned`), and raw logprobs equal processed ones only at temperature 1 (the runs here use 1.0).
One extra server for the whole module; the restart reuses its port.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from integration.runs import make_server

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port
from asyncgrpo.store import AdapterStore, verify_adapter_files

REPO = Path(__file__).resolve().parents[2]
NO_DEV_MODE = {"VLLM_SERVER_DEV_MODE": "0"}
RAW_LOGPROBS = ["--logprobs-mode", "raw_logprobs"]  # after VLLMServer's own processed_logprobs: the last one wins
START_S = 600  # a vLLM CPU start takes ~30 s alone, minutes on a loaded 2-core machine


def _train(out: Path, url: str, *extra: str) -> subprocess.Popen:
    """One training process (no launcher) in the background; its stderr goes to out/train.log."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "asyncgrpo", "train", "--config", "configs/demo.yaml", "--max_steps", "8",
           "--per_device_train_batch_size", "32", "--output_dir", str(out), "--lora_adapter_path",
           str(out / "adapters"), "--vllm_server_base_url", url, "--sync_mode", "versioned", "--ddp_timeout", "120",
           "--max_inflight_requests", "8", *extra]
    log = open(out / "train.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env=cpu_launch_env(), stdout=log, stderr=subprocess.STDOUT)


def _serve(model_dir, port: int, log: Path) -> VLLMServer:
    server = make_server(model_dir, port, max_lora_rank=8, max_loras=4, max_model_len=256, log_path=log,
                         env=NO_DEV_MODE, extra_args=RAW_LOGPROBS)
    server.start()
    try:
        server.wait_ready(START_S)
    except BaseException:
        server.stop()
        raise
    return server


def _kill(server: VLLMServer) -> None:
    """SIGKILL the server and its engine process, as a node that dies; wait until the port is closed."""
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)


def _wait_for_version(client: InferenceClient, proc: subprocess.Popen, version: int, deadline_s: float,
                      before: set[str]) -> None:
    """Poll the server until the run serves adapter version >= `version` (a few steps are done); names in `before`
    were loaded before the run (an earlier run's adapters)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the server was killed"
        if any(int(m.group(1)) >= version for name in set(client.adapter_paths()) - before
               if (m := re.search(r"-v(\d+)$", name))):
            return
        time.sleep(0.2)
    raise AssertionError(f"no adapter version {version} within {deadline_s} s")


@pytest.fixture(scope="module")
def own_server(world, tmp_path_factory):
    """A server of this module's own (no dev mode), which the fault tests kill and restart on the same port."""
    log = tmp_path_factory.mktemp("faults") / "vllm.log"
    holder = {"server": _serve(world.model_dir, find_free_port(), log)}
    yield holder
    holder["server"].stop()


def test_doctor_passes_on_the_session_server(vllm_server, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo", "doctor", "--config", "configs/demo.yaml",
                           "--vllm_server_base_url", vllm_server.base_url, "--lora_adapter_path", str(tmp_path)],
                          cwd=REPO, env=cpu_launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.strip().startswith("PASS") for line in lines) == 13  # the directory + 12 server checks
    assert "PASS  not paused: GET /is_paused answers false" in proc.stdout
    assert "PASS  logprobs mode: processed_logprobs (from /server_info)" in proc.stdout
    assert "PASS  no model sampling defaults: --generation-config vllm" in proc.stdout
    assert "PASS  max_lora_rank: --max-lora-rank 8 >= lora_r=8" in proc.stdout
    assert "PASS  adapter readable by server: a rank-8 probe adapter" in proc.stdout
    assert lines[-1] == "all checks passed"
    assert list(tmp_path.iterdir()) == []  # the probe adapter was deleted again
    with InferenceClient(vllm_server.base_url) as client:
        assert not [n for n in client.adapter_paths() if n.startswith("asyncgrpo-doctor-")]  # and unloaded


def test_doctor_names_the_missing_dev_mode_for_pause_sync(own_server, tmp_path):
    url = own_server["server"].base_url
    cmd = [sys.executable, "-m", "asyncgrpo", "doctor", "--config", "configs/demo.yaml", "--vllm_server_base_url",
           url, "--lora_adapter_path", str(tmp_path)]
    proc = subprocess.run([*cmd, "--sync_mode", "pause"], cwd=REPO, env=cpu_launch_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert ("FAIL  dev mode: sync_mode: pause needs /pause and /resume, and the server has neither. Fix: start it "
            "with VLLM_SERVER_DEV_MODE=1") in proc.stdout
    assert "SKIP  max_lora_rank: not checked: the server has no /server_info" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "1 check(s) failed"
    versioned = subprocess.run([*cmd, "--sync_mode", "versioned"], cwd=REPO, env=cpu_launch_env(),
                               capture_output=True, text=True, timeout=300)
    assert versioned.returncode == 0, versioned.stdout  # the same server is fine for versioned sync


def test_doctor_fails_a_raw_logprobs_server_when_the_config_samples_at_another_temperature(own_server, tmp_path):
    url = own_server["server"].base_url
    cmd = [sys.executable, "-m", "asyncgrpo", "doctor", "--config", "configs/demo.yaml", "--vllm_server_base_url",
           url, "--lora_adapter_path", str(tmp_path), "--sync_mode", "versioned"]
    hot = subprocess.run([*cmd, "--temperature", "0.7"], cwd=REPO, env=cpu_launch_env(), capture_output=True,
                         text=True, timeout=300)
    assert hot.returncode == 1, hot.stdout + hot.stderr[-3000:]
    line = next(line.strip() for line in hot.stdout.splitlines() if "logprobs mode" in line)
    # No /server_info without dev mode: the mode was probed at two temperatures.
    assert re.fullmatch(r"FAIL  logprobs mode: the server returns raw_logprobs \(probed: top logprobs moved by "
                        r"\S+ between temperature 1 and 0.5\), the logprobs of the model before temperature 0.7: "
                        r"every completion would be trained as if off-policy. Fix: restart it with --logprobs-mode "
                        r"processed_logprobs \(.*\)", line), line
    assert hot.stdout.splitlines()[-1] == "1 check(s) failed"
    neutral = subprocess.run(cmd, cwd=REPO, env=cpu_launch_env(), capture_output=True, text=True, timeout=300)
    assert "PASS  logprobs mode: raw_logprobs (probed" in neutral.stdout  # temperature 1.0: raw == processed


def test_the_logprobs_probe_tells_processed_from_raw_without_server_info(vllm_server, own_server):
    from types import SimpleNamespace

    from asyncgrpo.inference.checks import ServerContext, logprobs_mode

    modes = {}
    for name, url in (("session", vllm_server.base_url), ("own", own_server["server"].base_url)):
        with InferenceClient(url) as client:
            ctx = ServerContext(SimpleNamespace(), client, "", cache={"server_config": None})  # force the probe
            modes[name] = logprobs_mode(ctx)[0]
    assert modes == {"session": "processed_logprobs", "own": "raw_logprobs"}


def test_a_killed_server_that_restarts_costs_groups_not_the_run(own_server, world, tmp_path, tb_scalars):
    server = own_server["server"]
    with InferenceClient(server.base_url) as client:
        before = set(client.adapter_paths())
    proc = _train(tmp_path, server.base_url, "--vllm_server_timeout", str(START_S + 60))
    try:
        with InferenceClient(server.base_url) as client:
            _wait_for_version(client, proc, 3, deadline_s=300, before=before)
        _kill(server)
        offset = server.log_path.stat().st_size  # the restarted server's log starts here
        server = own_server["server"] = _serve(world.model_dir, server.port, server.log_path)
        assert proc.wait(timeout=600) == 0, (tmp_path / "train.log").read_text()[-5000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "train.log").read_text()
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["steps"] == 8 and summary["version"] == 8  # training continued to the end
    with InferenceClient(server.base_url) as client:
        assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    assert f"inference server {server.base_url} is back after" in log
    # The restarted server generated nothing before the current adapter was loaded on it: read its own access log. A
    # request already sent may reach it first (its connection retries outlast the restart); that one is answered 404
    # (the adapter does not exist) and lost with the outage's other groups.
    calls = re.findall(r'"POST (/v1/load_lora_adapter|/v1/completions) HTTP/[\d.]+" (\d+)',
                       server.log_path.read_text()[offset:])
    first_load = [path for path, _ in calls].index("/v1/load_lora_adapter")
    assert all(status == "404" for _, status in calls[:first_load]), calls[:first_load + 1]
    assert ("/v1/completions", "200") in calls[first_load:]
    # Lost groups are the requests that failed on the dead server; whether one was in flight at the kill is timing,
    # so assert the count is consistent everywhere it is reported, not its size.
    lost = summary["lost_groups"]
    # One outage, logged once down and once back (not once per failed request), with the count of failed calls.
    assert len(re.findall(r"WARNING .*stopped answering", log)) == 1, log[-5000:]
    back = re.findall(r"is back after \S+ s; the current adapter is registered on it; (\d+) calls? failed during the "
                      r"outage", log)
    assert len(back) == 1 and int(back[0]) >= lost
    assert not re.search(r"WARNING .*(retry \d+/\d+|rollout request to \S+ lost)", log)
    assert tb_scalars(tmp_path / "tensorboard", "rollout/lost_groups_total")[-1][1] == lost
    assert summary["resent_groups"] == lost  # every lost prompt was sent again


def test_a_server_that_never_returns_ends_the_run_with_the_fix(own_server, tmp_path):
    server = own_server["server"]
    with InferenceClient(server.base_url) as client:
        before = set(client.adapter_paths())  # the previous test's run left its last version loaded
    proc = _train(tmp_path, server.base_url, "--vllm_server_timeout", "5", "--max_steps", "50")
    try:
        with InferenceClient(server.base_url) as client:
            _wait_for_version(client, proc, 1, deadline_s=300, before=before)
        _kill(server)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "train.log").read_text()
    assert code == 2, log[-5000:]
    # The producer or the sync (whichever met the dead server first) ends the run with the same explanation.
    error = next(line for line in log.splitlines() if line.startswith("asyncgrpo: error: "))
    assert (f"inference server {server.base_url} stopped answering and did not come back within 5 s "
            f"(vllm_server_timeout). Fix: restart it on the same address") in error
    assert not (tmp_path / "run_summary.json").exists()
    # The adapters written before the fault are kept whole (how many steps ran before the kill is timing, and
    # keep_adapter_versions prunes the oldest, so the check is on what is there, not on version 1).
    roots = [p.parent for p in (tmp_path / "adapters").glob("*/v0*")]
    assert roots, "the adapters written before the fault must be kept"
    assert not list(roots[0].glob(".tmp-*")), "no half-written adapter directory is left"
    store = AdapterStore(roots[0])  # (opening a store cleans .tmp-* itself, so that was checked first)
    assert store.versions() and max(store.versions()) >= 1
    for version in store.versions():
        verify_adapter_files(store.path(version))  # every kept version is complete: sizes and sha256 as written
