"""Users' callbacks, called as transformers' Trainer calls a `TrainerCallback`: `on_train_begin`, `on_step_end`,
`on_log`, `on_evaluate`, `on_save`, `on_train_end`, each with `(args, state, control, **kwargs)`. A callback may
define any of them (a `TrainerCallback` subclass, or any object). Which rank calls which hook: docs/python-api.md.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

HOOKS = ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


class Callbacks:
    """The run's callbacks with transformers' `TrainerState` and `TrainerControl` (built once the run's shape is
    known: `begin`). Empty, every call returns at once and nothing of transformers is imported."""

    def __init__(self, callbacks=None):
        self.callbacks = list(callbacks or [])
        self.args = None  # the run's AsyncGRPOConfig, as `args` (TRL passes its GRPOConfig)
        self.state = None  # transformers.TrainerState
        self.control = None  # transformers.TrainerControl
        self.objects: dict = {}  # model, processing_class, optimizer, lr_scheduler: the kwargs Trainer passes too

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def begin(self, cfg, *, step: int, is_main: bool, is_local_main: bool, **objects) -> None:
        """Every rank, once set up: the state at `step` (0, or a checkpoint's), then `on_train_begin`."""
        if not self.callbacks:
            return
        from transformers import TrainerControl, TrainerState  # heavy: only with callbacks; torch is loaded anyway

        self.args, self.objects = cfg, objects
        self.state = TrainerState(global_step=step, max_steps=cfg.max_steps, logging_steps=cfg.logging_steps,
                                  save_steps=cfg.save_steps or 500, eval_steps=cfg.eval_steps or 500,
                                  train_batch_size=cfg.per_device_train_batch_size,
                                  is_world_process_zero=is_main, is_local_process_zero=is_local_main)
        self.control = TrainerControl()
        self._call("on_train_begin")

    def step_end(self, step: int) -> None:
        """Every rank, after each optimizer step (and its weight sync)."""
        if self.callbacks:
            self.state.global_step = step
            self._call("on_step_end")

    def log(self, values: dict[str, float], step: int) -> None:
        """Rank 0, where the step's metrics are, every `logging_steps`: `on_log(..., logs=values)`."""
        if self.callbacks:
            self.state.global_step = step
            self.state.log_history.append({**values, "step": step})
            self._call("on_log", logs=dict(values))

    def evaluate(self, metrics: dict[str, float], step: int) -> None:
        """Rank 0, after each evaluation: `on_evaluate(..., metrics=metrics)`."""
        if self.callbacks:
            self.state.global_step = step
            self.state.log_history.append({**metrics, "step": step})
            self._call("on_evaluate", metrics=dict(metrics))

    def save(self, step: int) -> None:
        """Every rank, once checkpoint-<step> is written."""
        if self.callbacks:
            self._call("on_save")

    def end(self) -> None:
        if self.callbacks:
            self._call("on_train_end")

    @property
    def stop_requested(self) -> bool:
        """A callback set `control.should_training_stop` on this rank (the recipe agrees on it across ranks)."""
        return bool(self.callbacks) and bool(self.control.should_training_stop)

    def _call(self, hook: str, **kwargs) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            result = method(self.args, self.state, self.control, **self.objects, **kwargs)
            if result is not None and hasattr(result, "should_training_stop"):
                self.control = result  # transformers lets a hook return the control it changed
