"""When the trainer has the rollout side evaluate the live adapter on `eval_dataset` (`eval_strategy: steps`)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncgrpo.config import EvalSettings, OutputSettings


@dataclass
class EvaluatorSettings(EvalSettings, OutputSettings):
    """The sections the evaluator reads: eval_strategy and eval_steps, else logging_steps (OutputSettings)."""

    @property
    def evaluation_interval(self) -> int:
        return self.interval(self.logging_steps)


@dataclass(frozen=True)
class Evaluator:
    """Evaluates every `every` optimizer steps (`eval_steps`, else `logging_steps`: a multiple of weight_sync_steps,
    so right after a sync, on the version just published) and at the last step; `every` None: never
    (`eval_strategy: no`)."""

    every: int | None

    @classmethod
    def from_config(cls, cfg: EvaluatorSettings) -> Evaluator:
        return cls(every=cfg.evaluation_interval if cfg.eval_strategy == "steps" else None)

    def should_evaluate(self, step: int, *, last_step: bool) -> bool:
        return self.every is not None and (step % self.every == 0 or last_step)
