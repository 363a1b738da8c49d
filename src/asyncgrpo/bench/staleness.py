"""`asyncgrpo bench staleness --json [--plot FILE.png] [--num_iterations 3] [--grid 0,2,4] [--corrections ...]`: does
the loss hold the held-out reward at high staleness?

The toy task trained at each `max_staleness` with each correction (`CORRECTIONS`) and several seeds against one vLLM
CPU server; `TRAINER_DELAY_S` of sleep after each step lets the producer run ahead, as on a trainer-bound cluster.
How staleness is made to occur: docs/benchmarks.md ("`bench staleness`"); the measured grid: docs/losses.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

from asyncgrpo.bench.throughput import save_figure, step_history
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import toy_world
from asyncgrpo.demo import default_config_path, heldout_rewards
from asyncgrpo.inference.checks import adapters_needed
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port
from asyncgrpo.trainer.recipe import GRPORecipe

STALENESS = (0, 2, 4, 8)
# What each correction adds to the config: `none` is the loss before `delta` became a default (no bound on the
# unclipped ratio, no importance weight), `default` the config's defaults, the IS modes the correction on top of them.
CORRECTIONS = ("none", "token_truncate", "token_mask")
CORRECTION_OVERRIDES = {"none": ["--delta", "null"], "default": []}
SEEDS = (0, 1, 2)
TRAINER_DELAY_S = 0.3  # per optimizer step: longer than generating one batch on the toy (~0.3 s/batch, throughput.py)
DEFAULT_WORKDIR = "runs/bench-staleness"
WORKLOAD = ["--max_steps", "60", "--per_device_train_batch_size", "256", "--torch_num_threads", "1",
            "--num_iterations", "1", "--weight_sync_steps", "1", "--sync_mode", "versioned"]
METRICS = ("staleness/mean", "staleness/max", "train/sampling/importance_sampling_ratio/mean",
           "train/sampling/importance_sampling_ratio/max", "train/sampling/is_capped_fraction",
           "train/sampling/kl_behaviour", "train/clip_ratio/region_mean", "train/loss", "train/grad_norm",
           "train/max_abs_log_ratio")


def cell_overrides(staleness: int, correction: str, seed: int, groups_per_step: int) -> list[str]:
    """The config overrides of one cell (on top of WORKLOAD and the user's overrides)."""
    extra = ["--max_staleness", str(staleness), "--seed", str(seed),
             "--max_inflight_requests", str(groups_per_step * (staleness + 1))]
    if correction in CORRECTION_OVERRIDES:
        return extra + CORRECTION_OVERRIDES[correction]
    return extra + ["--vllm_importance_sampling_correction", "true", "--vllm_importance_sampling_mode", correction]


def summarise(cells: list[dict]) -> list[dict]:
    """Per (max_staleness, correction): mean and spread (sample std, min, max) of the held-out reward over seeds,
    and its difference from the synchronous `none` cell's mean."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["max_staleness"], c["correction"]), []).append(c)
    sync = groups.get((0, "none"))
    sync_mean = statistics.fmean(c["heldout_reward"] for c in sync) if sync else None
    rows = []
    for (staleness, correction), members in sorted(groups.items()):
        rewards = [c["heldout_reward"] for c in members]
        mean = statistics.fmean(rewards)
        rows.append({"max_staleness": staleness, "correction": correction, "seeds": len(rewards),
                     "heldout_reward_mean": round(mean, 4),
                     "heldout_reward_std": round(statistics.stdev(rewards), 4) if len(rewards) > 1 else 0.0,
                     "heldout_reward_min": min(rewards), "heldout_reward_max": max(rewards),
                     "minus_sync": round(mean - sync_mean, 4) if sync_mean is not None else None,
                     "staleness_mean": round(statistics.fmean(c["staleness_mean"] for c in members), 3)})
    return rows


def plot_cells(rows: list[dict], path: str | Path) -> Path:
    """Held-out reward (mean +- std over seeds) against max_staleness, one line per correction."""
    # heavy: matplotlib, only with --plot
    import matplotlib

    matplotlib.use("Agg")
    # heavy: matplotlib, only with --plot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for correction in dict.fromkeys(r["correction"] for r in rows):
        mine = [r for r in rows if r["correction"] == correction]
        ax.errorbar([r["max_staleness"] for r in mine], [r["heldout_reward_mean"] for r in mine],
                    yerr=[r["heldout_reward_std"] for r in mine], marker="o", capsize=3, label=correction)
    ax.set_xlabel("max_staleness (versions)")
    ax.set_ylabel("held-out reward (mean of seeds)")
    ax.legend()
    return save_figure(fig, path)


def run_cell(cfg, world, client) -> dict:
    """Train one cell with TRAINER_DELAY_S after every step, then measure its held-out reward."""
    trainer = GRPORecipe(cfg)
    train_step = trainer.train_step

    def slow_step():
        stats = train_step()
        time.sleep(TRAINER_DELAY_S)  # emulate a trainer-bound cluster: the producer gets ahead
        return stats

    trainer.train_step = slow_step
    try:
        trainer.setup()
        trainer.train()
        adapter = trainer.rollout.adapter_name
    finally:
        trainer.cleanup()
    history = step_history(Path(cfg.output_dir) / "tensorboard", tags=METRICS)
    # Per cell: the mean over steps of each step metric, and for the maxima (`.../max`, `max_...`) their maximum.
    means = {k.replace("/", "_"): round((max if k.endswith("max") or "/max_" in k else statistics.fmean)(
        [h[k] for h in history if k in h]), 4) for k in METRICS if any(k in h for h in history)}
    nonfinite = sum(not math.isfinite(h[k]) for h in history for k in ("train/loss", "train/grad_norm") if k in h)
    rewards = heldout_rewards(cfg, client, adapter, world)
    return {"heldout_reward": round(rewards["sampled"], 4), "heldout_greedy_accuracy": round(rewards["greedy"], 4),
            "groups_dropped_stale": trainer.rollout.parts.queue.dropped_stale, "nonfinite_steps": nonfinite, **means}


def run(server_url: str | None, overrides: list[str], workdir: str | None = None, plot: str | None = None,
        stalenesses=STALENESS, corrections=CORRECTIONS, seeds=SEEDS, num_iterations: int = 1) -> dict:
    """Build the toy world, start a vLLM server unless `server_url` is given, run every cell. `num_iterations`:
    optimizer steps per generated batch (the same `max_steps` optimizer steps, so fewer batches)."""
    overrides = ["--num_iterations", str(num_iterations), *overrides]
    base = AsyncGRPOConfig.load(default_config_path(), [*WORKLOAD, *overrides])
    world = toy_world(base)
    groups_per_step = base.groups_per_step(world_size=1)
    started = time.monotonic()
    work = Path(workdir or DEFAULT_WORKDIR)
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if server_url is None:
            server = VLLMServer(world.model_dir, find_free_port(), max_loras=adapters_needed(max(stalenesses)),
                                max_model_len=256,
                                # requests beyond a batch wait in vLLM's queue; its default token budget (2048)
                                # must be >= max_num_seqs
                                max_num_seqs=min(1024, base.num_generations * groups_per_step * (max(stalenesses) + 1)),
                                log_path=work / "vllm.log")
            server.start()
            stack.callback(server.stop)
            server.wait_ready()
            server_url = server.base_url
        client = InferenceClient(server_url, timeout_s=base.vllm_request_timeout)
        cells = []
        total = len(stalenesses) * len(corrections) * len(seeds)
        for staleness in stalenesses:
            for correction in corrections:
                for seed in seeds:
                    name = f"s{staleness}-{correction}-seed{seed}"
                    cfg = AsyncGRPOConfig.load(default_config_path(), [
                        *WORKLOAD, "--output_dir", str(work / name), "--lora_adapter_path", str(work / name / "a"),
                        "--vllm_server_base_url", server_url, *overrides,
                        *cell_overrides(staleness, correction, seed, groups_per_step)])
                    cell = {"max_staleness": staleness, "correction": correction, "seed": seed}
                    cells.append(cell | run_cell(cfg, world, client))
                    with open(work / "cells.jsonl", "a") as f:  # a long grid: each cell kept as it finishes
                        f.write(json.dumps(cells[-1]) + "\n")
                    print(f"[bench staleness] cell {len(cells)}/{total} {name}: held-out reward "
                          f"{cells[-1]['heldout_reward']} ({time.monotonic() - started:.0f} s)", file=sys.stderr,
                          flush=True)
    rows = summarise(cells)
    result = {"cells": cells, "summary": rows, "trainer_delay_s": TRAINER_DELAY_S, "num_iterations": num_iterations,
              "workload": dict(zip(WORKLOAD[::2], WORKLOAD[1::2])) | {"--num_iterations": str(num_iterations)},
              "overrides": overrides,
              "total_s": round(time.monotonic() - started, 1)}
    if plot:
        result["plot"] = str(plot_cells(rows, plot))
    return result
