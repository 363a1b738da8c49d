"""The one-rank check of the collective helpers (gpu_check's `collectives` launch) under gloo: the CPU twin of what
runs under NCCL on a lent GPU. Each run is a fresh process: the check makes a process group and FSDP2 state of its
own, which a test process that forks gloo ranks later must not inherit (tests/gloo.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from lent_image import as_on_the_image

from asyncgrpo.bench.collectives_check import EXPECTED_CALLS, REDUCED, failures

ROOT = Path(__file__).resolve().parents[3]


def run_check(out: Path, prelude: str = "") -> dict:
    """The check under gloo in a fresh interpreter as the lent image has it (cryptography hidden); `prelude` runs
    first, in that interpreter (to break a helper on purpose)."""
    code = textwrap.dedent(prelude) + (
        "\nimport sys\nfrom asyncgrpo.bench import collectives_check\n"
        f"sys.exit(collectives_check.main(['--out', {str(out)!r}, '--cpu']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=as_on_the_image({**os.environ, "PYTHONPATH": str(ROOT / "src")}), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def test_the_helpers_take_their_multi_rank_path_in_a_group_of_one_and_give_exact_values(tmp_path):
    r = run_check(tmp_path)
    assert r["failures"] == [], r["failures"]
    assert (r["backend"], r["world_size"], r["device"]) == ("gloo", 1, "cpu")
    assert EXPECTED_CALLS <= set(r["collectives_called"])  # each helper reached torch.distributed
    assert r["collective_tensor_devices"] == ["cpu"]
    assert r["objects"]["scatter_copied"] is True and r["objects"]["scatter_equal"] is True
    assert r["reductions"]["sums"] == REDUCED  # float64 all the way: 1e16 + 2 and 0.1 exactly
    assert r["lora_gather"]["gather_max_abs_diff"] == 0.0
    assert r["lora_gather"]["gather_shapes"] == {"base_model.model.0.lora_A.weight": [3, 10],
                                                 "base_model.model.0.lora_B.weight": [7, 3],
                                                 "base_model.model.2.lora_A.weight": [3, 7],
                                                 "base_model.model.2.lora_B.weight": [5, 3]}
    assert r["lora_gather"]["gathered_bytes"] == r["lora_gather"]["adapter_bytes"] == (30 + 21 + 21 + 15) * 4
    assert r["rng"] == {"rng_cuda": False, "rng_restored": True, "rng_moved_on": True}
    assert not (tmp_path / "shared").exists() or not list((tmp_path / "shared").iterdir())


def test_without_forcing_the_early_return_is_caught(tmp_path):
    """The helpers left on their one-rank path call no collective: the check must say so, not pass."""
    r = run_check(tmp_path, """
        import contextlib
        from asyncgrpo.bench import collectives_check
        forced = collectives_check.multi_rank_path
        @contextlib.contextmanager
        def recorded_only():
            from asyncgrpo import distributed
            with forced() as recorder:
                distributed.is_distributed = lambda: False
                yield recorder
        collectives_check.multi_rank_path = recorded_only
        """)
    assert any("never called" in f and "scatter_object_list" in f for f in r["failures"]), r["failures"]
    assert any("scatter_copied" in f for f in r["failures"]), r["failures"]


@pytest.mark.parametrize("prelude, says", [
    ("""
        import torch
        from asyncgrpo import distributed
        distributed._all_reduce = lambda values, op: torch.tensor(values, dtype=torch.float32).tolist()
     """, "sums"),
    ("""
        from asyncgrpo.trainer import gather
        real = gather.gather_fsdp2
        def shuffled(acc, model):
            state, moved = real(acc, model)
            key = sorted(state)[0]
            state[key] = state[key].flip(0)
            return state, moved
        gather.gather_fsdp2 = shuffled
     """, "LoRA gather"),
    ("""
        from asyncgrpo.trainer import checkpoint
        checkpoint.restore_rng = lambda path, rank: None
     """, "RNG"),
])
def test_a_broken_helper_fails_the_check(tmp_path, prelude, says):
    r = run_check(tmp_path, prelude)
    assert any(says in f for f in r["failures"]), r["failures"]


def passing() -> dict:
    return {"backend": "nccl", "world_size": 1, "device": "cuda:0",
            "collectives_called": sorted(EXPECTED_CALLS), "collective_tensor_devices": ["cuda:0"],
            "objects": {"scatter_equal": True, "scatter_copied": True, "broadcast_equal": True,
                        "all_gather": [["rank", 0]], "on_main_result": 42, "on_main_reraised": "raised on purpose"},
            "reductions": {"sums": list(REDUCED), "maxima": list(REDUCED), "sum": 2.5, "max": -1.5},
            "shared_dir": {"shared_dir_probes_left": []},
            "lora_gather": {"gather_keys_match": True, "gather_max_abs_diff": 0.0, "gathered_bytes": 348,
                            "adapter_bytes": 348},
            "rng": {"rng_cuda": True, "rng_restored": True, "rng_moved_on": True}}


@pytest.mark.parametrize("path, value, says", [
    (("collective_tensor_devices",), ["cpu", "cuda:0"], "want only cuda:0"),
    (("reductions", "sums"), [0.1, 1e16, -3.25], "sums"),
    (("objects", "all_gather"), [["rank", 0], ["rank", 0]], "all_gather_object"),
    (("lora_gather", "gathered_bytes"), 400, "moved 400 bytes"),
    (("shared_dir", "shared_dir_probes_left"), [".asyncgrpo-shared-probe-x"], "left"),
    (("rng",), {"error": "RuntimeError: no CUDA generator"}, "rng raised"),
])
def test_each_kind_of_failure_is_named(path, value, says):
    result = passing()
    assert failures(result) == []
    target = result
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    found = failures(result)
    assert len(found) == 1 and says in found[0], found
