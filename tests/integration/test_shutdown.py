"""Entry points ended by a signal leave nothing running: `python -m asyncgrpo.inference_node.vllm_server` on SIGTERM, SIGINT,
SIGHUP (while vLLM starts or once it serves) and SIGKILL, and `asyncgrpo demo` on SIGTERM mid-training. Every pid of
the entry point's tree (vLLM's API server, engine core, workers, the guard, the training ranks) is collected before
the signal and must be gone after it. And `train` SIGTERMed as scancel does it (every process of the launch) saves a
checkpoint at the next step it can resume from exactly, and the resumed run ends with the uninterrupted run's adapter."""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
from safetensors.torch import load_file

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.inference_node.vllm_server import find_free_port

REPO = Path(__file__).resolve().parents[2]
START_S = 600  # a vLLM CPU start takes ~30-60 s alone, minutes on a loaded 2-core machine
GONE_S = 60  # the server's stop grace (15 s) + the guard's SIGTERM-then-SIGKILL grace (15 s), with room


def tree(pid: int) -> dict[int, str]:
    """pid -> command line of `pid` and every process below it, now."""
    out = {}
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            out[proc.pid] = " ".join(proc.cmdline()) or proc.name()
        except psutil.NoSuchProcess:
            pass
    return out


def gone(pid: int) -> bool:
    """Exited (a zombie nobody has reaped yet counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_all_gone(pids: dict[int, str]) -> None:
    deadline = time.monotonic() + GONE_S
    while (left := {p: c for p, c in pids.items() if not gone(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # leave nothing to the next test, then fail
        with _quiet():
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {GONE_S} s after the signal: {left}"


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, (ProcessLookupError, PermissionError))


def wait_for(condition, proc: subprocess.Popen, what: str, timeout_s: float = START_S):
    """Poll `condition()` until it is truthy (returned), failing if `proc` exits first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode} before {what}"
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout_s} s")


def engine_core_started(pid: int) -> bool:
    return any("EngineCore" in cmd for cmd in tree(pid).values())


def read_line(proc: subprocess.Popen):
    """The next stdout line if one is ready now, else None."""
    ready, _, _ = select.select([proc.stdout], [], [], 0)
    return proc.stdout.readline() if ready else None


@pytest.mark.parametrize("signum, when", [(signal.SIGTERM, "serving"), (signal.SIGINT, "starting"),
                                          (signal.SIGHUP, "serving"), (signal.SIGKILL, "serving")],
                         ids=["SIGTERM-serving", "SIGINT-starting", "SIGHUP-serving", "SIGKILL-serving"])
def test_the_server_module_leaves_nothing_running_after_a_signal(world, tmp_path, signum, when):
    proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo.inference_node.vllm_server", "--model", str(world.model_dir),
                             "--max-model-len", "256", "--log-path", str(tmp_path / "vllm.log")],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        if when == "starting":  # the engine core is up, the API server not yet answering
            wait_for(lambda: engine_core_started(proc.pid), proc, "vLLM engine core")
        else:
            url = wait_for(lambda: read_line(proc), proc, "base URL on stdout").strip()
            assert requests.get(f"{url}/health", timeout=5).status_code == 200
        pids = tree(proc.pid)
        assert any("EngineCore" in c for c in pids.values()) and any("asyncgrpo.children" in c for c in pids.values())
        proc.send_signal(signum)
        proc.wait(timeout=GONE_S)
        assert_all_gone(pids)
    finally:
        proc.kill()
        proc.wait()


def test_demo_ended_by_sigterm_mid_training_leaves_nothing_running(world, tmp_path):
    port = find_free_port()
    proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo", "demo", "--port", str(port), "--output_dir",
                             str(tmp_path), "--lora_adapter_path", str(tmp_path / "adapters"), "--max_steps", "40"],
                            cwd=REPO, env=cpu_launch_env())
    try:
        def serving_an_adapter():  # training has published at least one version: mid-training
            try:
                models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"]
            except (requests.RequestException, ValueError, KeyError):
                return False
            return len(models) > 1

        wait_for(serving_an_adapter, proc, "adapter served")
        pids = tree(proc.pid)
        assert sum("EngineCore" in c for c in pids.values()) == 1
        assert sum(" train " in f" {c} " for c in pids.values()) >= 2, pids  # the launch's ranks
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GONE_S) == 143
        assert_all_gone(pids)
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_to_a_training_launch_saves_a_checkpoint_that_resumes_to_the_uninterrupted_adapter(vllm_server,
                                                                                                     ddp_reference,
                                                                                                     tmp_path):
    # As scancel does: SIGTERM to every process of the launch (the launcher passes it on to the ranks once more).
    from integration.runs import DDP_REFERENCE_STEPS, run_launch, train_command, version_dir

    url, b_out = vllm_server.base_url, tmp_path / "b"
    with open(tmp_path / "b.log", "w") as log:
        proc = subprocess.Popen(train_command(b_out, url, "--save_steps", "100", "--max_steps", "1000"), cwd=REPO,
                                env=cpu_launch_env("ddp"), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for(lambda: list(b_out.glob("adapters/*/v000002")), proc, "adapter version 2 written")
        pids = tree(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=GONE_S)
        assert_all_gone(pids)
    finally:
        with _quiet():
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = (tmp_path / "b.log").read_text()
    checkpoints = sorted(b_out.glob("checkpoint-*"))
    assert len(checkpoints) == 1, text[-5000:]
    step = json.loads((checkpoints[0] / "manifest.json").read_text())["state"]["step"]
    assert step >= 2 and f"stopped on SIGTERM after step {step} with a checkpoint" in text

    b = run_launch(train_command(b_out, url, "--save_steps", "100", "--max_steps", str(step + 2),
                                 "--resume_from_checkpoint", "latest"))
    assert (b["start_step"], b["steps"]) == (step, step + 2)
    _, a = ddp_reference  # the uninterrupted run, every version kept
    if step + 2 > DDP_REFERENCE_STEPS:  # a signal that landed late: an uninterrupted run as long as B
        a = run_launch(train_command(tmp_path / "a", url, "--max_steps", str(step + 2)))
    final_a = load_file(version_dir(a, step + 2) / "adapter_model.safetensors")
    final_b = load_file(f"{b['adapter_path']}/adapter_model.safetensors")
    assert max((final_a[k] - final_b[k]).abs().max().item() for k in final_a) < 1e-5
