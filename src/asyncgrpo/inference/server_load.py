"""One vLLM server's load, read from its Prometheus `GET /metrics`: what `adaptive_inflight` (rollout/concurrency.py)
decides on."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLoad:
    """One server's `/metrics` now: sequences running and waiting in its scheduler, the fraction of its KV cache
    used."""

    running: float
    waiting: float
    kv_cache_usage: float


METRICS = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv_cache_usage"}
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")  # name{labels} value [timestamp]


def parse_server_load(text: str) -> ServerLoad | None:
    """The load in a Prometheus text exposition of vLLM (`GET /metrics`): requests summed over engines, the fullest
    engine's KV cache; None if the text has none of the three (not vLLM, or a version that renamed them)."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        field = METRICS.get(match.group(1)) if match else None
        if field is None:
            continue
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if math.isfinite(value):
            found.setdefault(field, []).append(value)
    if not found:
        return None
    return ServerLoad(running=sum(found.get("running", [0.0])), waiting=sum(found.get("waiting", [0.0])),
                      kv_cache_usage=max(found.get("kv_cache_usage", [0.0])))
