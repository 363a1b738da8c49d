"""`asyncgrpo bench throughput --json [--plot docs/throughput.png] [--modes batch,stream] [--staleness 0,1,2]`:
does asynchrony pay off?

The same toy workload and number of optimizer steps trained with `max_staleness` 0, 1 and 2 (in each rollout mode
asked for, `batch` alone by default) against one vLLM CPU server, server and trainer pinned to separate cores; per
run: steps/s, the idle fractions of trainer and server, staleness, held-out reward, the generation wasted or
re-sampled. The workload (`BALANCE`) and every figure: docs/benchmarks.md ("`bench throughput`").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import psutil

from asyncgrpo.bench.modes import compare_to_sync, default_rollout_mode, generation_figures, mode_settings
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import toy_world
from asyncgrpo.demo import default_config_path, heldout_rewards
from asyncgrpo.inference.checks import adapters_needed
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port
from asyncgrpo.timeline import complement, fraction
from asyncgrpo.trainer.recipe import GRPORecipe

STALENESS = (0, 1, 2)
DEFAULT_WORKDIR = "runs/bench-throughput"
WARMUP_STEPS = 2
# The workload on top of configs/demo.yaml (overrides on the command line win): one trainer process of 32 prompts
# x 8 completions per step, adapters activated without pausing generation (`sync_mode: versioned`), and the
# balancing knob `num_iterations`, published once per batch (see BALANCE_NOTE).
BALANCE = ["--max_steps", "120", "--per_device_train_batch_size", "256", "--torch_num_threads", "1",
           "--num_iterations", "3", "--weight_sync_steps", "3", "--sync_mode", "versioned"]
BALANCE_NOTE = ("Balanced by num_iterations 3: per generated batch (256 completions of ~3 tokens) the server needs "
                "~0.3 s (vLLM's CPU LoRA kernels and per-step overheads; batch size, num_generations and "
                "max_completion_length move generation and training alike), one optimizer step ~0.1 s. With 3 steps "
                "per batch both sides take ~0.3 s per batch; at 2 the run is generation-bound, at 4 training-bound "
                "and its held-out reward at max_staleness 2 fell 0.05-0.08 below synchronous in three runs. Server "
                "CPU-s include vLLM's spin-wait (its shm queue busy-loops for 1 s after each read), so they "
                "overstate generation's cost.")


def split_cores() -> dict:
    """The cores the server and the trainer get: server core 0, trainer the rest (one core on a 2-core box)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {"server": cores, "trainer": cores, "note": "fewer than 2 cores: server and trainer share"}
    return {"server": cores[:1], "trainer": cores[1:2],
            "note": f"vLLM (API server + engine, worker bound by VLLM_CPU_OMP_THREADS_BIND={cores[0]}) on core "
                    f"{cores[0]}; trainer process (torch 1 thread + rollout producer threads) on core {cores[1]}"}


def max_sequences(cfg, staleness: int) -> int:
    """Completions the server may be asked for at once (requests in flight x num_generations, one trainer process):
    its `--max-num-seqs`, so that no request waits for a second scheduling wave."""
    at = dataclasses.replace(cfg, max_staleness=staleness)
    return cfg.num_generations * at.inflight_requests(cfg.groups_per_step(world_size=1))


def run_summary(*, staleness: int, steps: int, t0: float, t1: float, waits: list, busy: list, history: list[dict],
                generated_tokens: int) -> dict:
    """The figures of one run from what it recorded (timelines as (start, end) monotonic seconds)."""
    wall = t1 - t0
    trained_tokens = sum(h.get("train/tokens", 0.0) for h in history)
    stale_mean = [h["staleness/mean"] for h in history if "staleness/mean" in h]
    stale_max = [h["staleness/max"] for h in history if "staleness/max" in h]
    return {"max_staleness": staleness, "steps": steps, "wall_s": round(wall, 3),
            "steps_per_s": round(steps / wall, 4) if wall > 0 else 0.0,
            "trainer_idle_fraction": round(fraction(waits, t0, t1), 4),
            "inference_idle_fraction": round(1.0 - fraction(busy, t0, t1), 4),
            "staleness_mean": round(sum(stale_mean) / len(stale_mean), 4) if stale_mean else None,
            "staleness_max": max(stale_max) if stale_max else None,
            "generated_tokens_per_s": round(generated_tokens / wall, 1) if wall > 0 else 0.0,
            "trained_tokens_per_s": round(trained_tokens / wall, 1) if wall > 0 else 0.0}


def timeline_record(staleness: int, t0: float, t1: float, waits: list, busy: list) -> dict:
    """One run's timelines relative to its start: trainer busy = the complement of its waits."""
    rel = lambda items: [[round(s - t0, 4), round(e - t0, 4)] for s, e in items]  # noqa: E731
    return {"max_staleness": staleness, "wall_s": round(t1 - t0, 4), "trainer_busy": rel(complement(waits, t0, t1)),
            "trainer_idle": rel(waits), "server_busy": rel(busy), "server_idle": rel(complement(busy, t0, t1))}


def plot_timelines(records: list[dict], path: str | Path, title: str = "") -> Path:
    """Draw trainer and server busy intervals of each run as a broken-bar timeline; writes a PNG at `path`."""
    # heavy: matplotlib, only with --plot
    import matplotlib

    matplotlib.use("Agg")
    # heavy: matplotlib, only with --plot
    import matplotlib.pyplot as plt

    rows = len(records)
    fig, axes = plt.subplots(rows, 1, figsize=(10, 1.2 + 1.1 * rows), squeeze=False, sharex=True)
    longest = max((r["wall_s"] for r in records), default=1.0)
    for ax, rec in zip(axes[:, 0], records):
        for y, key, colour in ((1, "trainer_busy", "tab:blue"), (0, "server_busy", "tab:orange")):
            bars = [(s, e - s) for s, e in rec[key]]
            ax.broken_barh([(0, rec["wall_s"])], (y - 0.35, 0.7), facecolors="0.92")
            ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=colour)
        ax.set_yticks([0, 1], ["server", "trainer"])
        ax.set_xlim(0, longest)
        label = "synchronous" if rec["max_staleness"] == 0 else "asynchronous"
        extra = f", {rec['steps_per_s']:.2f} steps/s" if "steps_per_s" in rec else ""
        ax.set_title(f"max_staleness {rec['max_staleness']} ({label}{extra})", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds (coloured = busy, grey = idle)")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path) -> Path:
    """Lay out `fig`, write it as a PNG at `path` (its directory created), close it; the benches' plots end here."""
    # heavy: matplotlib, only with --plot
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def step_history(tensorboard_dir: Path, tags=("staleness/mean", "staleness/max", "train/tokens")) -> list[dict]:
    """Per-step values of `tags` as the trainer logged them to TensorBoard (logging_steps 1), oldest step first."""
    # heavy: tensorboard, only to read a finished run's event files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    acc.Reload()
    steps: dict[int, dict] = {}
    for tag in tags:
        if tag in acc.Tags().get("scalars", []):
            for event in acc.Scalars(tag):
                steps.setdefault(event.step, {})[tag] = event.value
    return [steps[k] for k in sorted(steps)]


def process_tree_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) used so far by process `pid` and all its descendants; None without a pid."""
    if pid is None:
        return None

    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
    return total


def run_one(cfg, world, client, server_pid: int | None = None) -> tuple[dict, dict]:
    """Train `cfg.max_steps` steps (timed), then measure the final adapter's held-out reward (not timed).
    CPU seconds are recorded too: unlike wall time they hardly change when other work shares the cores, so
    they show the generation/training balance even on a busy machine."""
    trainer = GRPORecipe(cfg)
    try:
        trainer.setup()
        server_cpu0, proc_cpu0, thread_cpu0 = process_tree_cpu_s(server_pid), time.process_time(), time.thread_time()
        t0 = time.monotonic()
        trainer.train()
        t1 = time.monotonic()
        cpu = {"training_thread": time.thread_time() - thread_cpu0, "trainer_process": time.process_time() - proc_cpu0}
        if server_pid is not None:
            cpu["server"] = process_tree_cpu_s(server_pid) - server_cpu0
        waits = trainer.wait_timeline.snapshot(t0, t1)
        busy = trainer.rollout.parts.producer.server_busy.snapshot(t0, t1)
        generated = trainer.rollout.parts.producer.generated_tokens
        adapter = trainer.rollout.adapter_name
        figures = rollout_figures(trainer.rollout.parts)
    finally:
        trainer.cleanup()
    summary = run_summary(staleness=cfg.max_staleness, steps=trainer.step, t0=t0, t1=t1, waits=waits, busy=busy,
                          history=step_history(Path(cfg.output_dir) / "tensorboard"), generated_tokens=generated)
    rewards = heldout_rewards(cfg, client, adapter, world)
    summary = {"rollout_mode": cfg.rollout_mode, "inflight_weight_updates": cfg.inflight_weight_updates, **summary}
    summary.update(heldout_reward=round(rewards["sampled"], 4), heldout_greedy_accuracy=round(rewards["greedy"], 4),
                   **figures, cpu_s_per_step={k: round(v / max(trainer.step, 1), 4) for k, v in cpu.items()})
    record = timeline_record(cfg.max_staleness, t0, t1, waits, busy) | {"steps_per_s": summary["steps_per_s"]}
    return summary, record


def rollout_figures(parts) -> dict:
    """What a finished run's rollout side counted: groups dropped as too old, and the shares of its generated tokens
    wasted in them or re-sampled after a move onto a newer version (bench/modes.py)."""
    producer, queue = parts.producer, parts.queue
    return {"groups_dropped_stale": queue.dropped_stale,
            **generation_figures(generated_tokens=producer.generated_tokens,
                                 dropped_stale_tokens=queue.dropped_stale_tokens,
                                 tokens_moved=producer.inflight_stats.tokens_moved)}


def start_pinned_server(stack, model_dir, work, cores: dict, **server_args) -> tuple[str, int]:
    """A vLLM server on `cores["server"]` (its OMP threads bound there), this process moved to `cores["trainer"]`;
    stopped when `stack` closes. Returns its URL and pid once it answers /health."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(cores["server"][0])}
    os.sched_setaffinity(0, cores["server"])  # the server inherits this affinity...
    server = VLLMServer(model_dir, find_free_port(), max_model_len=256, log_path=work / "vllm.log", env=env,
                        **server_args)
    try:
        server.start()
    finally:
        os.sched_setaffinity(0, cores["trainer"])  # ...and this process moves to the trainer's core
    stack.callback(server.stop)
    server.wait_ready()
    return server.base_url, server.process.pid


def run(server_url: str | None, overrides: list[str], workdir: str | None = None, plot: str | None = None,
        stalenesses=STALENESS, modes=("batch",)) -> dict:
    """Build the toy world, start a pinned vLLM server unless `server_url` is given, run each staleness in each
    rollout mode (modes outer: `batch` at 0 first, the synchronous reference)."""
    base = AsyncGRPOConfig.load(default_config_path(), [*BALANCE, *overrides])
    world = toy_world(base)
    cores = split_cores() if server_url is None else {"note": f"external server {server_url}: nothing pinned"}
    load_before = os.getloadavg()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        work = Path(workdir or DEFAULT_WORKDIR)
        work.mkdir(parents=True, exist_ok=True)
        server_pid = None
        if server_url is None:
            server_url, server_pid = start_pinned_server(stack, world.model_dir, work, cores,
                                                         max_loras=adapters_needed(max(stalenesses)),
                                                         max_num_seqs=max_sequences(base, max(stalenesses)))
        client = InferenceClient(server_url, timeout_s=base.vllm_request_timeout)
        def config(staleness: int, name: str, *extra: str):
            return AsyncGRPOConfig.load(default_config_path(), [
                *BALANCE, "--max_staleness", str(staleness), "--output_dir", str(work / name),
                "--lora_adapter_path", str(work / name / "adapters"), "--vllm_server_base_url", server_url,
                *overrides, *extra])

        # Untimed warm-up: the server's first LoRA requests are slow (~2 s); no timed run should pay for them.
        warm = GRPORecipe(config(0, "warmup", "--max_steps", str(WARMUP_STEPS)))
        try:
            warm.setup()
            warm.train()
        finally:
            warm.cleanup()
        runs, records = [], []
        for mode in modes:
            settings = [f"--{k}={v}" for k, v in mode_settings(mode, episodes=False).items()]
            for staleness in stalenesses:
                name = f"s{staleness}" if modes == ("batch",) else f"{mode}-s{staleness}"
                shutil.rmtree(work / name / "tensorboard", ignore_errors=True)  # this run's steps only
                summary, record = run_one(config(staleness, name, *settings), world, client, server_pid)
                runs.append(summary)
                records.append(record)
        (work / "timelines.json").write_text(json.dumps(records))
        compare_to_sync(runs, "heldout_reward")
        result = {"default_rollout_mode": default_rollout_mode(), "runs": runs, "cores": cores, "balance": BALANCE_NOTE,
                  "config": dict(zip(BALANCE[::2], BALANCE[1::2])),
                  "overrides": overrides, "loadavg_before": [round(x, 2) for x in load_before],
                  "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                  "total_s": round(time.monotonic() - started, 1), "timelines": str(work / "timelines.json")}
        if plot:
            result["plot"] = str(plot_timelines(records, plot, title=_plot_title(result)))
        return result


def _plot_title(result: dict) -> str:
    la = result["loadavg_before"][0]
    return f"asyncgrpo bench throughput: {result['runs'][0]['steps']} steps per run, load average {la:.1f} before"
