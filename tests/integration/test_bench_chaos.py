"""`asyncgrpo bench chaos` for a few steps: a real vLLM CPU server, a real receiver and a real 2-rank gloo launch
(started by the bench itself, since it kills them), with one fault of each of three kinds at seeded steps: a
training rank killed (the run ends and is resumed from its checkpoint), the receiver killed and restarted, malformed
requests to every listening port (both survived in-run). Nothing the bench started may be running after it exits."""

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import psutil

from integration.runs import REPO

from asyncgrpo.bench.chaos import plan
from asyncgrpo.bench.sync import cpu_launch_env

STEPS, SAVE_STEPS, SEED = 12, 4, 0
KINDS = "rank,receiver,malformed"


def _run_collecting_descendants(cmd: list[str], timeout_s: float) -> tuple[subprocess.Popen, str, str, dict]:
    """Run `cmd`, and while it runs, every process below it (pid -> command line): the vLLM server, its engine
    core and worker, the receiver, the launches, their ranks and rollout processes, the guards."""
    seen: dict[int, str] = {}
    with open(os.devnull, "rb") as null, subprocess.Popen(cmd, cwd=REPO, env=cpu_launch_env(), stdin=null,
                                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                          text=True) as proc:
        out: list[str] = []
        err: list[str] = []
        readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
                   for s, b in ((proc.stdout, out), (proc.stderr, err))]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            assert time.monotonic() < deadline, "bench chaos did not finish in time"
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    # the latest: vLLM renames its processes once started
                    seen[p.pid] = " ".join(p.cmdline()) or p.name()
            time.sleep(0.5)
        for reader in readers:
            reader.join()
    return proc, "".join(out), "".join(err), seen


def _still_running(pids: dict[int, str]) -> dict[int, str]:
    """Those of `pids` still running with the same command line (a reused pid is someone else's)."""
    left = {}
    for pid, cmd in pids.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and " ".join(p.cmdline()) == cmd:
                left[pid] = cmd
    return left


def test_bench_chaos_survives_or_resumes_every_fault_and_leaves_nothing_running(tmp_path):
    workdir = str(tmp_path / "chaos")
    proc, stdout, stderr, descendants = _run_collecting_descendants(
        [sys.executable, "-m", "asyncgrpo", "bench", "chaos", "--json", "--steps", str(STEPS), "--seed", str(SEED),
         "--faults", "3", "--kinds", KINDS, "--save_steps", str(SAVE_STEPS), "--workdir", workdir],
        timeout_s=1800)  # ~2 min on a quiet machine, 12 on a loaded one
    assert proc.returncode == 0, stderr[-5000:]
    result = json.loads(stdout)
    assert result["finished"] is True, json.dumps(result["segments"])[-3000:]
    # The plan is the seed's: one fault of each kind, after the first checkpoint, before the last step.
    expected = plan(STEPS, 3, tuple(KINDS.split(",")), SEED, first_step=SAVE_STEPS + 1)
    assert [(f["kind"], f["step"]) for f in result["faults"]] == [(f["kind"], f["step"]) for f in expected]
    assert sorted(f["kind"] for f in result["faults"]) == sorted(KINDS.split(","))
    assert result["faults_by_kind"]["receiver"] == {"injected": 1, "survived": 1, "ended_run_resumed": 0,
                                                    "not_handled": 0}
    assert result["faults_by_kind"]["malformed"]["survived"] == 1
    assert result["faults_by_kind"]["rank"] == {"injected": 1, "survived": 0, "ended_run_resumed": 1,
                                                "not_handled": 0}
    assert result["finished"] is True and result["runs_resumed"] == 1
    ended, final = result["segments"]
    assert ended["exit_code"] != 0 and ended["errors"], ended  # a clear error, and a checkpoint to resume from
    assert ended["checkpoint_step"] >= SAVE_STEPS and final["start_step"] == ended["checkpoint_step"]
    assert result["steps_redone"] == ended["reached_step"] - ended["checkpoint_step"]
    malformed = next(f for f in result["faults"] if f["kind"] == "malformed")["answers"]
    roles = {port.split(":")[0] for port in malformed["ports"]}
    assert {"vllm_server", "receiver"} <= roles, malformed  # every listening port, the servers' ones included
    assert malformed["processes_gone_after"] == []
    # The receiver (our own HTTP server) answers each kind with its own status, before and without the key.
    receiver = next(answers for port, answers in malformed["ports"].items() if port.startswith("receiver:"))
    assert receiver == {"garbage_bytes": "HTTP/1.1 400 Bad Request", "bad_json": "HTTP/1.1 401 Unauthorized",
                        "oversized_header": "HTTP/1.1 431 Request Header Fields Too Large",
                        "wrong_keys": "HTTP/1.1 401 Unauthorized"}
    assert result["served_vs_trained"]["max_abs_logprob_diff"] < 1e-3  # fp32 on both sides
    assert result["left_running"] == {} and result["goal"]["nothing_left_running"] is True
    # Seen from outside too: every process the bench had below it at any time has exited.
    kinds = sorted({c[:80] for c in descendants.values()})
    assert any("EngineCore" in c for c in descendants.values()), kinds
    assert any(" train " in c for c in descendants.values()), kinds
    assert _still_running(descendants) == {}
