"""The rollout modes `bench throughput` and `bench agent` compare (`--modes`), and the figures each run adds to
their JSON: how much generation was wasted or re-sampled, and the speedup over the synchronous run.

Modes: `batch` and `stream` are `rollout_mode`'s values; `stream+inflight` is stream with completions moved onto
each new version mid-generation (`inflight_weight_updates`; for episodes with `episode_version: latest`, which it
needs there). What each mode does: docs/rollout-internals.md.
"""

from __future__ import annotations

from asyncgrpo.config import AsyncGRPOConfig

MODES = ("batch", "stream", "stream+inflight")


def parse_modes(text: str) -> tuple[str, ...]:
    """`--modes batch,stream+inflight` -> ("batch", "stream+inflight"); an unknown name is refused, naming the choices."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown rollout mode(s) {unknown or text!r}: choose from {', '.join(MODES)}")
    return modes


def mode_settings(mode: str, *, episodes: bool) -> dict:
    """The config keys a run of `mode` sets (episodes: the agent workload, whose turns move between turns only)."""
    if mode == "batch":
        return {"rollout_mode": "batch", "inflight_weight_updates": False}
    if mode == "stream":
        return {"rollout_mode": "stream", "inflight_weight_updates": False}
    if episodes:  # turns move mid-generation, and each starts on the newest version
        return {"rollout_mode": "stream", "inflight_weight_updates": True, "episode_version": "latest"}
    return {"rollout_mode": "stream", "inflight_weight_updates": True}


def default_rollout_mode() -> str:
    """The mode a config that does not name one runs in."""
    return AsyncGRPOConfig.__dataclass_fields__["rollout_mode"].default


def generation_figures(*, generated_tokens: int, dropped_stale_tokens: int, tokens_moved: int) -> dict:
    """Of the sampled tokens that reached the queue: the fraction in groups dropped as too old (generated for
    nothing), and the fraction sampled by a newer version after their completion moved onto it."""
    def share(part: int) -> float:
        return round(part / generated_tokens, 4) if generated_tokens else 0.0

    return {"generated_tokens_wasted_fraction": share(dropped_stale_tokens),
            "tokens_resampled_fraction": share(tokens_moved)}


def compare_to_sync(runs: list[dict], quality: str) -> list[dict]:
    """Each run's `speedup_over_sync` (steps/s over the synchronous run's: `batch` at max_staleness 0, else any run
    at 0) and its `quality` figure minus the synchronous run's, as `<quality>_minus_sync` (None without one)."""
    at_zero = [r for r in runs if r["max_staleness"] == 0]
    sync = next((r for r in at_zero if r.get("rollout_mode", "batch") == "batch"), at_zero[0] if at_zero else None)
    for r in runs:
        r["speedup_over_sync"] = round(r["steps_per_s"] / sync["steps_per_s"], 3) if sync else None
        r[f"{quality}_minus_sync"] = round(r[quality] - sync[quality], 4) if sync else None
    return runs
