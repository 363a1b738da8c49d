"""Served == trained, live: each checked version's probe (contracts.ServedProbe) is scored by every server under the
version's adapter name and compared with the trainer's logprobs; a difference above the run's bound stops the run,
naming the server, the version and what the served logprobs match instead (the base, an older version, neither).
Why a fixed probe and how the bounds were measured: docs/publish-internals.md, "Served == trained, live".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from asyncgrpo.config import AsyncSettings, ModelSettings
from asyncgrpo.contracts import ServedProbe
from asyncgrpo.errors import ServedPolicyError

log = logging.getLogger(__name__)

# The largest |served - trained| logprob a correct sync may show on the probe, by the run's torch_dtype, from
# measurement (docs/publish-internals.md): fp32 trainer and fp32 server agreed to 1.1e-6 on the toy, while one
# optimizer step moved the probe by 0.012-0.048; a bf16 trainer against an fp32 server to 0.023 on the toy, and bf16
# against bf16 to 0.063 over 512 tokens of a 0.5B model. In bf16 a version is told from the previous one only when a
# step moves the probe by more than the bound (`sync/served_probe_change` says by how much it did).
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
HISTORY = 8  # older versions' expected logprobs kept to name which one a wrong server serves


@dataclass
class ServedCheckSettings(AsyncSettings, ModelSettings):
    """The sections the check reads: served_check_every/_tolerance (AsyncSettings) and torch_dtype (ModelSettings),
    whose bound applies when no tolerance is set."""


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


@dataclass
class ServedCheck:
    """The expected logprobs of the probe under every recently checked version (and the base), and the comparison.
    `expect` is called once per version before it is activated; `verify` on each server's thread after (read only)."""

    tolerance: float
    dtype: str
    by_dtype: bool = False  # no served_check_tolerance: the bound follows the base dtype the trainer really ran
    base: list[float] | None = None
    token_ids: list[int] | None = None
    history: dict[int, list[float]] = field(default_factory=dict)  # version -> the trainer's logprobs

    @classmethod
    def from_config(cls, cfg: ServedCheckSettings) -> ServedCheck | None:
        if not cfg.served_check_every:
            return None
        bound = cfg.served_check_tolerance if cfg.served_check_tolerance is not None else TOLERANCE[cfg.torch_dtype]
        return cls(tolerance=bound, dtype=cfg.torch_dtype, by_dtype=cfg.served_check_tolerance is None)

    def bound(self, probe: ServedProbe) -> tuple[float, str]:
        """(the bound, the dtype it is for): torch_dtype's, or the probe's when the trainer built its base in a
        lower precision than torch_dtype says (a DeepSpeed json with bf16 on)."""
        if self.by_dtype and TOLERANCE.get(probe.dtype, 0.0) > self.tolerance:
            return TOLERANCE[probe.dtype], probe.dtype
        return self.tolerance, self.dtype

    def expect(self, version: int, probe: ServedProbe) -> float | None:
        """Record `probe` as version `version`'s; returns how far the trainer's logprobs moved since the last checked
        version on the same probe (None for a probe's first version): what the check can tell apart."""
        if probe.token_ids != self.token_ids:  # a new probe (a resumed run's): what was kept is for other tokens
            self.token_ids, self.base, self.history = list(probe.token_ids), None, {}
        if probe.base_logprobs is not None:
            self.base = list(probe.base_logprobs)
        previous = self.history[max(self.history)] if self.history else None
        self.history[version] = list(probe.logprobs)
        for old in sorted(self.history)[:-HISTORY]:
            del self.history[old]
        return None if previous is None else max_abs_diff(probe.logprobs, previous)

    def verify(self, client, name: str, version: int, probe: ServedProbe) -> float:
        """Score the probe on `client` under `name` and compare; returns the max abs difference, or raises
        ServedPolicyError above the bound."""
        served = client.score(name, probe.token_ids)[probe.start:]
        diff = max_abs_diff(served, probe.logprobs)
        bound, dtype = self.bound(probe)
        if diff > bound:
            what = f"torch_dtype {dtype}" if dtype == self.dtype else f"a {dtype} base under torch_dtype {self.dtype}"
            raise ServedPolicyError(
                f"server {client.base_url} does not serve policy version {version} under {name!r}: its logprobs of "
                f"the {len(served)}-token probe differ from the trainer's by up to {diff:.4g} (bound "
                f"{bound:g} for {what}). {self.likely_cause(served, version, bound)}")
        return diff

    def likely_cause(self, served: list[float], version: int, bound: float | None = None) -> str:
        """Which logprobs the served ones match instead: the base model's, an older version's, or none."""
        near = {}
        if self.base is not None:
            near["the base model (the adapter loaded but not applied, or a zero adapter)"] = max_abs_diff(served,
                                                                                                        self.base)
        for old, logprobs in self.history.items():
            if old != version:
                near[f"version {old}, an older adapter (the server re-read or kept an old copy)"] = max_abs_diff(
                    served, logprobs)
        if near:
            what, how_far = min(near.items(), key=lambda item: item[1])
            if how_far <= (self.tolerance if bound is None else bound):
                return (f"They match {what} (within {how_far:.3g}). Fix: check the adapter files the server read "
                        f"(docs/publish-internals.md, \"Served == trained, live\")")
        return ("They match neither the base model nor an older version: likely causes are a LoRA rank, alpha or "
                "target modules the server applies differently (--max-lora-rank, an edited adapter_config.json), "
                "another base model or dtype on the server than the trainer's, or --logprobs-mode *_logits (logits "
                "reported as logprobs). Fix: serve the trainer's model with launch/vllm/serve.sh's flags; if the "
                "server runs a lower precision than torch_dtype, raise served_check_tolerance")
