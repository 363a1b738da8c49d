"""scripts/gpu_check.sh end to end, CPU variant, as on the lent GPU image: the wrapper alone finds the sources, with
what that image lacks hidden (tests/lent_image.py) launches the trainer's step on a backend (2 gloo ranks, the toy
model), appends the backend's line and the summary to the results file and prints the summary as one JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

from lent_image import IMAGE_LACKS, as_on_the_image

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_launches_the_trainers_step_and_prints_one_passing_json_line(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the wrapper alone must find the sources
    env = as_on_the_image(env)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--backends", "ddp",
                           "--out", str(tmp_path / "out")], cwd="/", env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # library banners and progress go to stderr
    result = json.loads(lines[0])
    assert result["passed"] is True and result["exit_code"] == 0 and list(result["backends"]) == ["ddp"]
    ddp = result["backends"]["ddp"]
    assert ddp["ok"] and ddp["failures"] == []
    assert (ddp["backend"], ddp["world_size"], ddp["micro"]) == ("ddp", 2, 2)
    assert ddp["gathered_bytes"] == ddp["adapter_bytes"] > 0
    assert ddp["on_policy_max_abs_log_ratio"] < 1e-4 and ddp["chunked_vs_full_max_abs"] < 1e-4
    assert ddp["step_size"] > 0 and ddp["step_time_s"] > 0
    written = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [x.get("backend") for x in written] == ["ddp", None] and written[-1] == result
    assert written[0]["ok"] and written[0]["deadline_s"] > 0
    log = (tmp_path / "out" / "ddp.log").read_text()
    assert not any(f"No module named '{m}'" in log for m in IMAGE_LACKS), log[-3000:]
