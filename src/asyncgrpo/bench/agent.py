"""`asyncgrpo bench agent --json [--compare_versions] [--staleness 0,1,2] [--modes batch,stream]`: does asynchrony
pay off on episodes?

The toy agent world (docs/agents.md) with its long-tailed episodes (1-4 hops, so 2-5 turns) and `TOOL_LATENCY_S` of
simulated latency per tool call, trained at `max_staleness` 0, 1 and 2 (same seed, same number of optimizer steps)
against one vLLM CPU server, server and trainer on separate cores as in `bench throughput`. Per run: steps/s, the
speedup over the synchronous run, the trainer's idle fraction, and the final adapter's held-out success measured as
the agent demo measures it, and the generation wasted or re-sampled. `--modes` runs each staleness in each rollout
mode (bench/modes.py; `batch` alone by default). `--compare_versions` adds runs with `episode_version: latest` at
each staleness above 0. Before the runs (or alone, with `--overhead_only`) it measures what the agent endpoint adds
per model turn against the built-in episode loop (`endpoint_overhead` in the JSON).
The workload and the figures: docs/benchmarks.md ("`bench agent`").
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from asyncgrpo.bench import modes as rollout_modes
from asyncgrpo.bench.throughput import (max_sequences, process_tree_cpu_s, rollout_figures, run_summary, split_cores,
                                       start_pinned_server, step_history)
from asyncgrpo.config import parse_overrides
from asyncgrpo.demo_agent import agent_config, episode_figures, load_agent_config
from asyncgrpo.inference.checks import adapters_needed
from asyncgrpo.toy.agent_task import LookupEnv
from asyncgrpo.toy.agent_world import build_agent_world
from asyncgrpo.trainer.recipe import GRPORecipe

STALENESS = (0, 1, 2)
DEFAULT_WORKDIR = "runs/bench-agent"
WARMUP_STEPS = 2
TOOL_LATENCY_S = 0.1
"""Seconds each `lookup()` call sleeps: a slow tool, during which the episode's server slot is idle."""
NUM_ITERATIONS = 2
"""Optimizer steps per generated batch, one publish per batch (`weight_sync_steps` the same): balances training
against generation (docs/benchmarks.md, "`bench agent`")."""
WORKLOAD = {"max_steps": 60, "per_device_train_batch_size": 64, "sync_mode": "versioned", "seed": 0,
            "lora_name": "bench-agent"}
"""On top of the agent demo's config (overrides on the command line win): one trainer process of 8 questions x 8
episodes per batch, each new version activated without pausing generation."""


def run_config(world, work: Path, staleness: int, server_url: str, overrides: dict, name: str,
               num_iterations: int = NUM_ITERATIONS, **extra):
    """One run's config: the demo's, the bench's workload, this run's staleness and directories, the overrides."""
    return load_agent_config({**agent_config(world, output_dir=str(work / name)), **WORKLOAD,
                              "num_iterations": num_iterations, "weight_sync_steps": num_iterations,
                              "max_staleness": staleness, "vllm_server_base_url": server_url, **overrides, **extra})


def compare_to_sync(runs: list[dict]) -> list[dict]:
    """Each run's speedup over the synchronous run (max_staleness 0) and its held-out success minus the synchronous
    one's (None without a synchronous run, as with `--grid 1,2`)."""
    return rollout_modes.compare_to_sync(runs, "heldout_success")


def run_one(cfg, world, server_pid: int | None) -> dict:
    """Train `cfg.max_steps` steps (timed), then play the final adapter's held-out episodes (not timed)."""
    trainer = GRPORecipe(cfg)
    try:
        trainer.setup()
        server_cpu0 = process_tree_cpu_s(server_pid)
        t0 = time.monotonic()
        summary = trainer.train().metrics  # the run summary
        t1 = time.monotonic()
        server_cpu = None if server_pid is None else process_tree_cpu_s(server_pid) - server_cpu0
        waits = trainer.wait_timeline.snapshot(t0, t1)
        busy = trainer.rollout.parts.producer.server_busy.snapshot(t0, t1)
        generated = trainer.rollout.parts.producer.generated_tokens
        stats = trainer.rollout.stats()
        figures = rollout_figures(trainer.rollout.parts)
    finally:
        trainer.cleanup()
    result = run_summary(staleness=cfg.max_staleness, steps=trainer.step, t0=t0, t1=t1, waits=waits, busy=busy,
                         history=step_history(Path(cfg.output_dir) / "tensorboard"), generated_tokens=generated)
    heldout = episode_figures(world.model_dir, world.read_rows(heldout=True), Path(summary["adapter_path"]))
    sampled = heldout["sampled"]
    return {"rollout_mode": cfg.rollout_mode, "inflight_weight_updates": cfg.inflight_weight_updates,
            "max_staleness": cfg.max_staleness, "episode_version": cfg.episode_version, **result,
            "heldout_success": round(sampled["success"], 4),
            "heldout_greedy_success": round(heldout["greedy"]["success"], 4),
            "turns_mean": round(sampled["turns_mean"], 3), "tool_calls_per_episode": round(sampled["tool_calls_mean"], 3),
            "train_turns_mean": round(stats.get("episodes/turns_mean", 0.0), 3),
            "train_episodes": stats.get("episodes/total"), **figures,
            "server_cpu_s_per_step": round(server_cpu / max(trainer.step, 1), 4) if server_cpu is not None else None}


OVERHEAD_GROUPS = 12
"""Groups (of the demo's 8 episodes each) played by each loop in the endpoint-overhead measurement."""


def endpoint_overhead(world, server_url: str, values: dict, groups: int = OVERHEAD_GROUPS) -> dict:
    """Seconds per model turn of the toy agent's episodes played by the built-in loop (`environment_factory`) and
    by the toy agent written with the openai client through the agent endpoint (`agent_function`), on the base model,
    no training, tools without latency: the same rows, the two loops alternating group by group so that a change in
    the machine's load reaches both. The difference per turn is what the endpoint adds (HTTP, JSON, rendering the
    call's messages to link it)."""
    from transformers import AutoTokenizer  # heavy

    from asyncgrpo.demo_agent import endpoint_config
    from asyncgrpo.inference.client import InferenceClient
    from asyncgrpo.rollout.build import build_episode_runner

    latency, LookupEnv.latency_s = LookupEnv.latency_s, 0.0
    tokenizer = AutoTokenizer.from_pretrained(world.model_dir)
    plain = {**agent_config(world), **WORKLOAD, **values, "vllm_server_base_url": server_url}
    runners = {"builtin": build_episode_runner(load_agent_config(plain), tokenizer, str(world.model_dir), 256),
               "endpoint": build_episode_runner(load_agent_config(endpoint_config(plain)), tokenizer,
                                                str(world.model_dir), 256)}
    seconds, turns = {k: 0.0 for k in runners}, {k: 0 for k in runners}
    rows = overhead_rows(load_agent_config(plain), tokenizer, groups)
    try:
        with InferenceClient(server_url) as client:
            model = client.base_model()
            for row in rows:
                for name, runner in runners.items():
                    t0 = time.perf_counter()
                    episodes = runner.run_group(client, row, n=8, adapter=model, version=0, seed=None)
                    seconds[name] += time.perf_counter() - t0
                    turns[name] += sum(_turns(e) for e in episodes)
                    runner.release(episodes)
    finally:
        LookupEnv.latency_s = latency
        for runner in runners.values():
            runner.close()
    per_turn = {k: seconds[k] / max(turns[k], 1) for k in runners}
    return {"groups": len(rows), "episodes_per_group": 8, "turns": turns,
            "seconds_per_turn": {k: round(v, 5) for k, v in per_turn.items()},
            "overhead_per_turn_s": round(per_turn["endpoint"] - per_turn["builtin"], 5),
            "overhead_ratio": round(per_turn["endpoint"] / per_turn["builtin"], 3)}


def overhead_rows(cfg, tokenizer, groups: int) -> list:
    """The first `groups` training rows as the trainer loads them (chat rows, rendered and tokenised): episodes refuse
    a row that is not a chat row, as a bare dataset record would be."""
    from asyncgrpo.data import load_prompt_set

    return load_prompt_set(cfg, tokenizer).rows[:groups]


def _turns(episode) -> int:
    """Model turns of an episode of either loop (an agent episode's are its samples')."""
    return sum(s.turns for s in getattr(episode, "samples", [episode]))


def run(server_url: str | None, overrides: list[str], workdir: str | None = None, stalenesses=STALENESS,
        tool_latency_s: float = TOOL_LATENCY_S, num_iterations: int = NUM_ITERATIONS,
        compare_versions: bool = False, modes=("batch",), overhead_only: bool = False) -> dict:
    """Find (or build) the toy agent world, start a pinned vLLM server unless `server_url` is given, warm it up
    (untimed), then train at each staleness in each of `modes` (and, with `compare_versions`, again with
    `episode_version: latest` at each staleness above 0)."""
    LookupEnv.latency_s = tool_latency_s  # the environments run in this process's rollout threads
    world = build_agent_world()
    values = parse_overrides(overrides)
    per_run = {"num_iterations": num_iterations}
    work = Path(workdir or DEFAULT_WORKDIR)
    work.mkdir(parents=True, exist_ok=True)
    base = run_config(world, work, max(stalenesses), "http://127.0.0.1:1", values, "base", **per_run)
    cores = split_cores() if server_url is None else {"note": f"external server {server_url}: nothing pinned"}
    load_before = os.getloadavg()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        server_pid = None
        if server_url is None:
            server_url, server_pid = start_pinned_server(stack, world.model_dir, work, cores,
                                                         max_lora_rank=max(8, base.lora_r),
                                                         max_loras=adapters_needed(max(stalenesses)),
                                                         max_num_seqs=max_sequences(base, max(stalenesses)))
        # Untimed warm-up: the server's first LoRA requests are slow; no timed run should pay for them.
        if not overhead_only:
            warm = GRPORecipe(run_config(world, work, 0, server_url, values, "warmup", max_steps=WARMUP_STEPS,
                                         **per_run))
            try:
                warm.setup()
                warm.train()
            finally:
                warm.cleanup()
        overhead = endpoint_overhead(world, server_url, values)  # untimed for the runs below
        print(f"[bench agent] endpoint overhead: {overhead}", file=sys.stderr, flush=True)
        if overhead_only:
            return {"endpoint_overhead": overhead, "cores": cores, "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
        plan = [(mode, s, {"episode_version": base.episode_version, **rollout_modes.mode_settings(mode, episodes=True)})
                for mode in modes for s in stalenesses]
        plan += [("batch", s, {"episode_version": "latest"}) for s in stalenesses
                 if compare_versions and s > 0 and base.episode_version != "latest"]
        runs = []
        for mode, staleness, settings in plan:
            name = f"s{staleness}-{settings['episode_version']}" if modes == ("batch",) else \
                f"{mode}-s{staleness}-{settings['episode_version']}"
            shutil.rmtree(work / name / "tensorboard", ignore_errors=True)  # this run's steps only
            cfg = run_config(world, work, staleness, server_url, values, name, **per_run, **settings)
            runs.append(run_one(cfg, world, server_pid))
            with open(work / "runs.jsonl", "a") as f:  # a long bench: each run kept as it finishes
                f.write(json.dumps(runs[-1]) + "\n")
            print(f"[bench agent] {name}: {runs[-1]['steps_per_s']} steps/s, held-out success "
                  f"{runs[-1]['heldout_success']} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return {"default_rollout_mode": rollout_modes.default_rollout_mode(), "runs": compare_to_sync(runs),
            "endpoint_overhead": overhead, "settings": {**WORKLOAD, **values, "tool_latency_s": tool_latency_s,
                                                        "num_iterations": base.num_iterations,
                                                        "weight_sync_steps": base.weight_sync_steps,
                                       "episode_version": base.episode_version, "max_turns": base.max_turns,
                                       "warmup_steps": WARMUP_STEPS},
            "base_heldout_success": world.base_sampled["success"], "cores": cores,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()], "total_s": round(time.monotonic() - started, 1)}
