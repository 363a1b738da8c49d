"""`asyncgrpo bench rank0 --json [--server URL]`: how much does reward scoring slow rank 0's own work?

Four short toy runs against one vLLM CPU server: a trivial reward, then a heavy one scored in rank 0's request
threads, in a rollout process of its own, and in reward worker processes. The figure is rank 0's step time while it
is not waiting for data. The runs and figures: docs/benchmarks.md ("`bench rank0`").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import time
from pathlib import Path

from asyncgrpo.bench.throughput import max_sequences
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import toy_world
from asyncgrpo.demo import default_config_path
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port
from asyncgrpo.trainer.recipe import GRPORecipe

DEFAULT_WORKDIR = "runs/bench-rank0"
WARMUP_STEPS = 4
MS_PER_COMPLETION = 20.0  # slow_larger_reward's default: the CPU-heavy reward's cost per completion
TRIVIAL = "asyncgrpo.toy:larger_reward"
HEAVY = "asyncgrpo.toy.task:slow_larger_reward"
# (name, reward, reward_workers, rollout_process)
RUNS = (("trivial_reward", TRIVIAL, 0, False), ("heavy_reward_threads", HEAVY, 0, False),
        ("heavy_reward_process", HEAVY, 0, True), ("heavy_reward_workers", HEAVY, 2, False))
# On top of configs/demo.yaml: one trainer process, 8 prompts x 8 completions per step, the next batch generated
# (and scored) while this one trains, a sync after every step without pausing generation.
WORKLOAD = ["--max_steps", "14", "--per_device_train_batch_size", "64", "--torch_num_threads", "1",
            "--max_staleness", "1", "--weight_sync_steps", "1", "--sync_mode", "versioned", "--logging_steps", "1"]


class StepClock:
    """Wraps a trainer's `train_step` (on the instance) to record each step's wall time, queue wait and the
    training thread's CPU time."""

    def __init__(self, trainer):
        self.steps: list[dict] = []
        inner = trainer.train_step

        def timed():
            t0, cpu0 = time.perf_counter(), time.thread_time()
            stats = inner()
            wall = time.perf_counter() - t0
            waited = stats.values.get("time/wait_for_data_s", 0.0)
            self.steps.append({"start": t0, "end": t0 + wall, "wall_s": wall, "wait_s": waited,
                               "cpu_s": time.thread_time() - cpu0})
            return stats

        trainer.train_step = timed

    def summary(self, warmup: int) -> dict:
        """Means over the steps after `warmup`: busy step time, busy loop time (steps and what runs between them)."""
        measured = self.steps[warmup:]
        assert measured, f"no step after the {warmup} warm-up steps: raise --max_steps"
        begin = self.steps[warmup - 1]["end"] if warmup else measured[0]["start"]  # what ran between steps counts
        span = measured[-1]["end"] - begin
        waits = sum(s["wait_s"] for s in measured)
        return {"measured_steps": len(measured),
                "step_s": round(statistics.mean(s["wall_s"] - s["wait_s"] for s in measured), 4),
                "loop_s": round((span - waits) / len(measured), 4),
                "wait_s": round(waits / len(measured), 4),
                "train_thread_cpu_s": round(statistics.mean(s["cpu_s"] for s in measured), 4)}


def run_one(cfg) -> dict:
    """Train `cfg.max_steps` steps in this process (a single rank) and time rank 0's steps."""
    trainer = GRPORecipe(cfg)
    clock = StepClock(trainer)
    try:
        trainer.setup()
        t0 = time.monotonic()
        trainer.train()
        wall = time.monotonic() - t0
        fallbacks = trainer.rollout.stats()["reward/fallbacks_total"]
    finally:
        trainer.cleanup()
    return {"steps": trainer.step, "wall_s": round(wall, 2), "reward_fallbacks": fallbacks,
            **clock.summary(WARMUP_STEPS)}


def run(server_url: str | None, overrides: list[str], workdir: str | None = None) -> dict:
    """Build the toy world, start a vLLM server unless `server_url` is given, and run the three cases."""
    base = AsyncGRPOConfig.load(default_config_path(), [*WORKLOAD, *overrides])
    world = toy_world(base)
    work = Path(workdir or DEFAULT_WORKDIR)
    work.mkdir(parents=True, exist_ok=True)
    load_before, started = os.getloadavg(), time.monotonic()
    with contextlib.ExitStack() as stack:
        if server_url is None:
            server = VLLMServer(world.model_dir, find_free_port(), max_loras=4, max_model_len=256,
                                max_num_seqs=max_sequences(base, base.max_staleness), log_path=work / "vllm.log")
            server.start()
            stack.callback(server.stop)
            server.wait_ready()
            server_url = server.base_url
        runs = {}
        for name, reward, workers, in_process in RUNS:
            shutil.rmtree(work / name, ignore_errors=True)
            cfg = AsyncGRPOConfig.load(default_config_path(), [
                *WORKLOAD, "--reward_funcs", f"[{reward}]", "--reward_workers", str(workers),
                "--rollout_process", str(in_process).lower(),
                "--output_dir", str(work / name), "--lora_adapter_path", str(work / name / "adapters"),
                "--vllm_server_base_url", server_url, *overrides])
            runs[name] = {"reward": reward, "reward_workers": workers, "rollout_process": in_process,
                          **run_one(cfg)}
    trivial = runs["trivial_reward"]
    result = {f"step_s_{name}": r["step_s"] for name, r in runs.items()}
    result.update({
        "ratio_heavy_threads_over_trivial": _ratio(runs["heavy_reward_threads"]["step_s"], trivial["step_s"]),
        "ratio_heavy_process_over_trivial": _ratio(runs["heavy_reward_process"]["step_s"], trivial["step_s"]),
        "ratio_heavy_workers_over_trivial": _ratio(runs["heavy_reward_workers"]["step_s"], trivial["step_s"]),
        **{f"loop_s_{name}": r["loop_s"] for name, r in runs.items()},
        "ratio_loop_heavy_threads_over_trivial": _ratio(runs["heavy_reward_threads"]["loop_s"], trivial["loop_s"]),
        "ratio_loop_heavy_process_over_trivial": _ratio(runs["heavy_reward_process"]["loop_s"], trivial["loop_s"]),
        "ratio_loop_heavy_workers_over_trivial": _ratio(runs["heavy_reward_workers"]["loop_s"], trivial["loop_s"]),
        "runs": runs,
        "settings": {"workload": dict(zip(WORKLOAD[::2], WORKLOAD[1::2])), "overrides": overrides,
                     "warmup_steps": WARMUP_STEPS, "heavy_ms_per_completion": MS_PER_COMPLETION,
                     "completions_per_step": base.per_device_train_batch_size, "cpus": os.cpu_count(),
                     "server": server_url},
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "total_s": round(time.monotonic() - started, 1)})
    return result


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None
