"""A server left paused, against the session's real vLLM server (dev mode on): a previous run that was killed
during a sync leaves `/is_paused` true; `doctor` reports it with the fix, `train` resumes it and says so, and a
trainer that gets SIGTERM during a sync resumes the server itself before it exits with 143.

Every test leaves the session server resumed (`finally`), whatever happens."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.rollout.publish import HOLD_PAUSED_ENV

REPO = Path(__file__).resolve().parents[2]


def _cmd(command: str, url: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "asyncgrpo", command, "--config", "configs/demo.yaml", "--vllm_server_base_url",
            url, "--lora_adapter_path", str(out / "adapters"), *extra]


def _train(url: str, out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """A short training process (no launcher: it is rank 0) with pause sync; its output goes to out/train.log."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = _cmd("train", url, out, "--output_dir", str(out), "--sync_mode", "pause", "--max_steps", "3",
               "--per_device_train_batch_size", "32", "--max_inflight_requests", "4", "--ddp_timeout", "120", *extra)
    log = open(out / "train.log", "w")
    return subprocess.Popen(cmd, cwd=REPO, env={**cpu_launch_env(), **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT)


def _wait_for(path: Path, proc: subprocess.Popen, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        assert proc.poll() is None, "the run ended before it reached the point the test waits for"
        assert time.monotonic() < deadline, f"{path} did not appear within {deadline_s} s"
        time.sleep(0.1)


def test_doctor_fails_on_a_server_left_paused_and_names_post_resume(vllm_server, tmp_path):
    url = vllm_server.base_url
    with InferenceClient(url) as client:
        client.pause(mode="keep")  # what a run killed during a sync leaves behind
        try:
            proc = subprocess.run(_cmd("doctor", url, tmp_path), cwd=REPO, env=cpu_launch_env(), capture_output=True,
                                  text=True, timeout=300)
            assert client.is_paused() is True  # doctor reports, it does not change the server
        finally:
            client.resume()
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert (f"FAIL  not paused: {url} is paused (GET /is_paused answers true), most likely by a run killed during a "
            f"weight sync; it holds every request. Fix: `curl -X POST {url}/resume` (POST /resume); `asyncgrpo train` "
            f"resumes it at start") in proc.stdout
    assert proc.stdout.splitlines()[-1] == "1 check(s) failed"


def test_train_resumes_a_server_a_previous_run_left_paused_and_logs_it(vllm_server, tmp_path):
    url = vllm_server.base_url
    with InferenceClient(url) as client:
        client.pause(mode="keep")
        try:
            proc = _train(url, tmp_path, "--max_steps", "2")
            code = proc.wait(timeout=600)
        finally:
            client.resume()
    log = (tmp_path / "train.log").read_text()
    assert code == 0, log[-5000:]
    assert (f"{url} was paused (GET /is_paused answered true), most likely by a run killed during a weight sync; "
            f"this run resumed it (POST /resume) to use it") in log
    # Leftovers: of the versions it loaded, a finished run leaves only the final one (keep_final_adapter: true).
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    run_prefix = summary["adapter_name"].rsplit("-v", 1)[0] + "-v"
    with InferenceClient(url) as client:
        mine = {n for n in client.adapter_paths() if n.startswith(run_prefix)}
    assert summary["adapter_left_loaded"] == summary["adapter_name"]
    assert mine == {summary["adapter_name"]} and summary["version"] == 2
    assert all(oct(p.stat().st_mode & 0o777) == "0o644" for p in Path(summary["adapter_path"]).iterdir())


def test_sigterm_during_a_sync_resumes_the_server_before_the_trainer_exits_143(vllm_server, tmp_path):
    url = vllm_server.base_url
    marker = tmp_path / "paused-by-sync"
    # The test hook holds the first sync that pauses the server (version 1) paused until the process is signalled.
    proc = _train(url, tmp_path, "--max_steps", "20", env={HOLD_PAUSED_ENV: str(marker)})
    try:
        _wait_for(marker, proc, deadline_s=300)
        with InferenceClient(url) as client:
            assert client.is_paused() is True  # the trainer holds it paused mid-sync: the fault is real
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=120)
            paused_after = client.is_paused()
    finally:
        if proc.poll() is None:
            proc.kill()
        with InferenceClient(url) as client:
            client.resume()  # whatever happened, leave the session server usable
    log = (tmp_path / "train.log").read_text()
    assert code == 128 + signal.SIGTERM == 143, log[-5000:]
    assert paused_after is False, log[-5000:]
    assert "received SIGTERM: making sure no inference server is left paused, then exiting with 143" in log
    assert f"resumed {url}, which a weight sync in progress had paused" in log
    assert not (tmp_path / "run_summary.json").exists()
    with InferenceClient(url) as client:  # a run that did not finish unloads every version it loaded
        run_ids = [d.name for d in (tmp_path / "adapters").iterdir()]
        assert len(run_ids) == 1 and not [n for n in client.adapter_paths() if f"-{run_ids[0]}-v" in n]
    assert os.environ.get(HOLD_PAUSED_ENV) is None  # the hook is never on outside the signalled process
