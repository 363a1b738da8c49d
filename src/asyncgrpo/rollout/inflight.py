"""Completions that move onto each new policy version while they are sampled (`inflight_weight_updates`).

A request is streamed; when a newer version is served, the stream is closed (vLLM aborts the request) and every
unfinished completion is sent again as prompt + the tokens it sampled so far, on the new adapter. Each token keeps the
version and the behaviour logprob it was sampled with. What vLLM does to requests in flight, and why the trainer's
loss and staleness bound stay exact: docs/rollout-internals.md, "Weights updated in flight".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncgrpo.inference.client import Completion, InferenceClient

# `with policy() as (version, adapter)`: the version served now and its adapter name, counted as in use (so that a
# publisher does not unload it) until the block ends. Admission.latest is one.
PolicyNow = Callable[[], contextlib.AbstractContextManager[tuple[int, str]]]


@dataclass
class Sampled:
    """One completion sampled across versions: per token its id, behaviour logprob and the version that sampled it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "" while it is still to be continued

    @property
    def done(self) -> bool:
        return self.finish_reason not in ("", "abort")


@dataclass
class InflightStats:
    """What moving onto new versions cost: continuation requests sent, and tokens sampled past a completion's budget
    and cut (a continuation of several completions asks for the longest one's remaining budget); and how much of
    what was kept the newer versions sampled."""

    continuations: int = 0
    completions_moved: int = 0
    tokens_cut: int = 0
    tokens_moved: int = 0  # tokens kept that were sampled after their completion moved onto a newer version


def sample_across_versions(client: InferenceClient, prompt_ids: list[int], *, n: int, max_tokens: int,
                           first: tuple[int, str], policy: PolicyNow, served: Callable[[], int],
                           stats: InflightStats, temperature: float = 1.0, top_p: float = 1.0,
                           seed: int | None = None, extra: dict | None = None) -> list[Sampled]:
    """Sample `n` completions of `prompt_ids`, starting on `first` (version, adapter); whenever `served()` (the
    version served now) differs from the one a request runs on, the request stops and its unfinished completions go
    on from their tokens on the version `policy` gives. Every completion ends within `max_tokens`."""
    out = [Sampled() for _ in range(n)]
    version, adapter = first
    completions = client.complete_until(adapter, [prompt_ids], n=n, max_tokens=max_tokens, seed=seed,
                                        temperature=temperature, top_p=top_p, extra=extra,
                                        interrupted=lambda: served() != version)
    _extend(out, range(n), completions, version, max_tokens, stats)
    first_tokens = sum(len(s.token_ids) for s in out)
    while unfinished := [i for i, s in enumerate(out) if not s.done]:
        stats.continuations += 1
        stats.completions_moved += len(unfinished)
        with policy() as (version, adapter):
            budget = max_tokens - min(len(out[i].token_ids) for i in unfinished)
            prompts = [prompt_ids + out[i].token_ids for i in unfinished]
            completions = client.complete_until(adapter, prompts, n=1, max_tokens=budget, temperature=temperature,
                                                top_p=top_p, extra=extra,
                                                interrupted=lambda: served() != version)
        _extend(out, unfinished, completions, version, max_tokens, stats)
    stats.tokens_moved += sum(len(s.token_ids) for s in out) - first_tokens
    return out


def _extend(out: list[Sampled], which, completions: list[Completion], version: int, max_tokens: int,
            stats: InflightStats) -> None:
    """Append each completion's new tokens, tagged `version`, to its Sampled; a completion past `max_tokens` is cut
    there and ends as `length`, as the server would have ended it."""
    for i, c in zip(which, completions):
        s = out[i]
        room = max_tokens - len(s.token_ids)
        s.token_ids += c.token_ids[:room]
        s.logprobs += c.logprobs[:room]
        s.versions += [version] * min(len(c.token_ids), room)
        s.finish_reason = c.finish_reason
        if len(c.token_ids) > room or (len(s.token_ids) == max_tokens and not s.done):
            stats.tokens_cut += max(len(c.token_ids) - room, 0)
            s.finish_reason = "length"

