"""Benchmarks that print one JSON object: `asyncgrpo bench NAME --json`.

Each benchmark is a module here with a `run(...)` returning that object; what each measures and its latest figures:
docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys


def run_bench(args, overrides: list[str]) -> int:
    if args.name != "chaos":  # --seed and --save_steps are chaos's own flags, and config keys for the others
        overrides = [*(["--seed", str(args.seed)] if args.seed is not None else []),
                     *(["--save_steps", str(args.save_steps)] if args.save_steps is not None else []), *overrides]
    # Libraries print banners to stdout on import (DeepSpeed's accelerator warning): keep stdout for the JSON.
    with contextlib.redirect_stdout(sys.stderr):
        # heavy: each benchmark imports torch, transformers or vLLM's client side; import only the one asked for,
        # inside the redirect so that its import banners stay off stdout
        module = importlib.import_module(f"asyncgrpo.bench.{args.name}")
        if args.name == "sync":
            result = module.run(args.backend, server_url=args.server, overrides=overrides, model=args.model,
                                servers=args.servers, naive=not args.skip_naive)
        elif args.name == "memory" and args.model:  # a real-shape model under two ranks per backend
            module = importlib.import_module("asyncgrpo.bench.memory_ranks")
            backends = list(module.SHARDED) if args.backend == "all" else [args.backend]
            result = module.run(args.model, backends, list(args.variants), completions=args.completions,
                                completion_tokens=args.completion_tokens or 512, overrides=overrides)
        elif args.name == "memory":
            result = module.run(vocab_size=args.vocab_size, completion_tokens=args.completion_tokens or 1024)
        elif args.name in ("rank0", "policy_equivalence"):
            result = module.run(server_url=args.server, overrides=overrides)
        elif args.name == "throughput":
            extra = {k: v for k, v in (("stalenesses", args.staleness), ("modes", args.modes)) if v is not None}
            result = module.run(server_url=args.server, overrides=overrides, plot=args.plot, **extra)
        elif args.name == "staleness":
            grid = {k: v for k, v in (("stalenesses", args.grid), ("corrections", args.corrections),
                                      ("seeds", args.seeds)) if v is not None}
            result = module.run(server_url=args.server, overrides=overrides, plot=args.plot,
                                num_iterations=args.num_iterations or 1, **grid)
        elif args.name == "agent":
            extra = {k: v for k, v in (("stalenesses", args.staleness or args.grid), ("modes", args.modes),
                                       ("tool_latency_s", args.tool_latency),
                                       ("num_iterations", args.num_iterations)) if v is not None}
            result = module.run(server_url=args.server, overrides=overrides, compare_versions=args.compare_versions,
                                overhead_only=args.overhead_only, **extra)
        elif args.name == "chaos":
            extra = {"kinds": args.kinds} if args.kinds else {}
            result = module.run(overrides, steps=args.steps, seed=args.seed or 0, faults=args.faults,
                                baseline=args.baseline, save_steps=args.save_steps, workdir=args.workdir,
                                rollout_side=args.rollout_side, **extra)
        elif args.name == "producer":
            result = module.run(overrides=overrides, duration_s=args.duration)
        else:
            raise ValueError(f"unknown benchmark {args.name!r}")
    print(json.dumps(result))
    return 0
