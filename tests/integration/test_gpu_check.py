"""scripts/gpu_check.sh end to end, CPU variant: the wrapper alone finds the sources, launches the trainer's step on a
backend (2 gloo ranks, the toy model) and prints one JSON line with the verdict."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_launches_the_trainers_step_and_prints_one_passing_json_line():
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the wrapper alone must find the sources
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--backends", "ddp"],
                          cwd="/", env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # library banners and progress go to stderr
    result = json.loads(lines[0])
    assert result["passed"] is True and list(result["backends"]) == ["ddp"]
    ddp = result["backends"]["ddp"]
    assert ddp["ok"] and ddp["failures"] == []
    assert (ddp["backend"], ddp["world_size"], ddp["micro"]) == ("ddp", 2, 2)
    assert ddp["gathered_bytes"] == ddp["adapter_bytes"] > 0
    assert ddp["on_policy_max_abs_log_ratio"] < 1e-4 and ddp["chunked_vs_full_max_abs"] < 1e-4
    assert ddp["step_size"] > 0 and ddp["step_time_s"] > 0
