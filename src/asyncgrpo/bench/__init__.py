"""Benchmarks that print one JSON object: `asyncgrpo bench NAME --json`.

Each benchmark is a module here with a `run(...)` returning that object; what each measures and its latest figures:
docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import json
import sys


def run_bench(args, overrides: list[str]) -> int:
    from asyncgrpo.bench import policy_equivalence, throughput

    # Libraries print banners to stdout on import (DeepSpeed's accelerator warning): keep stdout for the JSON.
    with contextlib.redirect_stdout(sys.stderr):
        if args.name == "sync":
            from asyncgrpo.bench import sync

            result = sync.run(args.backend, server_url=args.server, overrides=overrides, model=args.model,
                              servers=args.servers)
        elif args.name == "memory":
            from asyncgrpo.bench import memory

            result = memory.run(vocab_size=args.vocab_size, completion_tokens=args.completion_tokens)
        elif args.name == "rank0":
            from asyncgrpo.bench import rank0

            result = rank0.run(server_url=args.server, overrides=overrides)
        elif args.name == "throughput":
            result = throughput.run(server_url=args.server, overrides=overrides, plot=args.plot)
        elif args.name == "producer":
            from asyncgrpo.bench import producer

            result = producer.run(overrides=overrides, duration_s=args.duration)
        elif args.name == "staleness":
            from asyncgrpo.bench import staleness

            result = staleness.run(server_url=args.server, overrides=overrides, plot=args.plot)
        else:
            result = policy_equivalence.run(server_url=args.server, overrides=overrides)
    print(json.dumps(result))
    return 0
