"""`asyncgrpo bench chaos` for a few steps: a real vLLM CPU server, a real receiver and a real 2-rank gloo launch
(started by the bench itself, since it kills them), with one fault of each of three kinds at seeded steps: a
training rank killed (the run ends and is resumed from its checkpoint), the receiver killed and restarted, malformed
requests to every listening port (both survived in-run). Nothing the bench started may be running after it exits."""

import json
import subprocess
import sys

import psutil

from integration.runs import REPO

from asyncgrpo.bench.chaos import plan
from asyncgrpo.bench.sync import cpu_launch_env

STEPS, SAVE_STEPS, SEED = 12, 4, 0
KINDS = "rank,receiver,malformed"


def _ours(workdir: str) -> list[str]:
    """Command lines of the processes still running that name the bench's directory (vLLM's log path, the receiver's
    directory, the training ranks' output_dir) or are its guards."""
    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if workdir in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(cmd)
    return left


def test_bench_chaos_survives_or_resumes_every_fault_and_leaves_nothing_running(tmp_path):
    workdir = str(tmp_path / "chaos")
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo", "bench", "chaos", "--json", "--steps", str(STEPS),
                           "--seed", str(SEED), "--faults", "3", "--kinds", KINDS, "--save_steps", str(SAVE_STEPS),
                           "--workdir", workdir],
                          cwd=REPO, env=cpu_launch_env(), capture_output=True, text=True,
                          timeout=1800)  # ~2 min on a quiet machine, 12 on a loaded one
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(proc.stdout)
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
    assert _ours(workdir) == []
