"""Benchmarks that print one JSON object: `asyncgrpo bench NAME --json`."""

from __future__ import annotations

import json


def run_bench(args, overrides: list[str]) -> int:
    from .policy_equivalence import run

    benches = {"policy_equivalence": run}
    result = benches[args.name](server_url=args.server, overrides=overrides)
    print(json.dumps(result))
    return 0
