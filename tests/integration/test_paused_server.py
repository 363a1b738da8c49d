"""A server left paused, against the session's real vLLM server (dev mode on): a previous run that was killed
during a sync leaves `/is_paused` true; `doctor` reports it with the fix, `train` resumes it and says so, and a
trainer that gets SIGTERM during a sync resumes the server itself before it exits with 143.

Every test leaves the session server resumed (`finally`), whatever happens."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from integration.runs import REPO, held_sync, is_paused, run_adapters, train

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference.client import InferenceClient


def _train(url: str, out: Path, *extra: str) -> subprocess.Popen:
    """A short training process with pause sync; its output goes to out/train.log."""
    return train(url, out, "--sync_mode", "pause", "--max_steps", "3", *extra)


def test_doctor_fails_on_a_server_left_paused_and_names_post_resume(vllm_server, tmp_path):
    url = vllm_server.base_url
    with InferenceClient(url) as client:
        client.pause(mode="keep")  # what a run killed during a sync leaves behind
        try:
            doctor = [sys.executable, "-m", "asyncgrpo", "doctor", "--config", "configs/demo.yaml",
                      "--vllm_server_base_url", url, "--lora_adapter_path", str(tmp_path / "adapters")]
            proc = subprocess.run(doctor, cwd=REPO, env=cpu_launch_env(), capture_output=True, text=True, timeout=300)
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
    with InferenceClient(url) as client:
        mine = set(run_adapters(client, summary))
    assert summary["adapter_left_loaded"] == summary["adapter_name"]
    assert mine == {summary["adapter_name"]} and summary["version"] == 2
    umask = os.umask(0o022)
    os.umask(umask)  # the files follow the umask (the run's, which is ours)
    assert all(p.stat().st_mode & 0o777 == 0o666 & ~umask for p in Path(summary["adapter_path"]).iterdir())


def test_sigterm_during_a_sync_resumes_the_server_before_the_trainer_exits_143(vllm_server, tmp_path):
    url = vllm_server.base_url
    # The proxy holds the first sync that pauses the server (version 1) paused until the trainer resumes it.
    with held_sync(url, tmp_path, "--max_steps", "20") as (proxy_url, proc):
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        paused_after = is_paused(url)
    log = (tmp_path / "train.log").read_text()
    assert code == 128 + signal.SIGTERM == 143, log[-5000:]
    assert paused_after is False, log[-5000:]
    assert "received SIGTERM: making sure no inference server is left paused, then exiting with 143" in log
    assert f"resumed {proxy_url}, which a weight sync in progress had paused" in log
    assert not (tmp_path / "run_summary.json").exists()
    with InferenceClient(url) as client:  # a run that did not finish unloads every version it loaded
        run_ids = [d.name for d in (tmp_path / "adapters").iterdir()]
        assert len(run_ids) == 1 and not [n for n in client.adapter_paths() if f"-{run_ids[0]}-v" in n]
