"""The files a TRL user looks for beside an adapter: `trainer_state.json` in each checkpoint and a model card.

`LogHistory` keeps rank 0's logged metrics under the names transformers' `log_history` uses (`train/loss` -> `loss`,
`eval/reward` -> `eval_reward`) and writes them into transformers' `TrainerState` layout; `model_card` is the
README.md of the final adapter and of each checkpoint. Both are built from what rank 0 holds: no network.
docs/checkpoints.md and docs/running.md show them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.config import (AgentSettings, CheckpointSettings, DataSettings, EvalSettings, GenerationSettings,
                              ModelSettings, TrainingSettings)
from asyncgrpo.rewards import reward_name
from asyncgrpo.trainer.evaluator import EvaluatorSettings
from asyncgrpo.version import __version__


def history_names(values: dict[str, float]) -> dict[str, float]:
    """Tracker names -> transformers' `log_history` names: its loggers add `train/` to every key and turn `eval_`
    into `eval/`, so the history holds them without (`train/rewards/f/mean` -> `rewards/f/mean`)."""
    out = {}
    for key, value in values.items():
        if key.startswith("eval/"):
            key = "eval_" + key.removeprefix("eval/")
        out[key.removeprefix("train/")] = value
    return out


@dataclass
class TrainerStateSettings(EvaluatorSettings, TrainingSettings, CheckpointSettings):
    """The sections trainer_state.json reports: the evaluation, logging and save intervals and the run's length."""


@dataclass
class CardSettings(DataSettings, AgentSettings, EvalSettings, TrainingSettings, ModelSettings, GenerationSettings):
    """The sections the model card describes: the data and rewards, held-out prompts, the LoRA and training keys."""


@dataclass
class LogHistory:
    """Rank 0's `log_history`: one entry per logging step (and per evaluation), each with its `step`, oldest first.
    A resumed run starts from its checkpoint's entries."""

    entries: list[dict] = field(default_factory=list)

    @classmethod
    def resumed(cls, trainer_state: dict | None) -> LogHistory:
        """The history of the checkpoint resumed from (none: a checkpoint written before trainer_state.json)."""
        entries = (trainer_state or {}).get("log_history") or []
        return cls([dict(e) for e in entries])

    def log(self, values: dict[str, float], step: int) -> None:
        self.entries.append({**history_names(values), "step": step})

    def last_evaluation(self) -> dict | None:
        """The newest entry holding an evaluation's figures (`eval_...`), or None."""
        return next((e for e in reversed(self.entries) if any(k.startswith("eval_") for k in e)), None)

    def trainer_state(self, cfg: TrainerStateSettings, step: int) -> dict:
        """transformers' `TrainerState` as `save_to_json` writes it (every field it has, none it lacks, so that
        `TrainerState.load_from_json` reads it back). asyncgrpo keeps no best model (`best_*` are null), counts
        no FLOPs or input tokens (0, transformers' value when it does not track them), and its data stream has no
        epochs (`epoch` null; `num_train_epochs` when one was set)."""
        return {"best_global_step": None, "best_metric": None, "best_model_checkpoint": None, "epoch": None,
                "eval_steps": cfg.evaluation_interval, "global_step": step, "is_hyper_param_search": False,
                "is_local_process_zero": True, "is_world_process_zero": True, "log_history": self.entries,
                "logging_steps": cfg.logging_steps, "max_steps": cfg.max_steps, "num_input_tokens_seen": 0,
                "num_train_epochs": cfg.num_train_epochs or 0, "save_steps": cfg.save_steps,
                "stateful_callbacks": {}, "total_flos": 0, "train_batch_size": cfg.per_device_train_batch_size,
                "trial_name": None, "trial_params": None}

    def trainer_state_json(self, cfg: TrainerStateSettings, step: int) -> str:
        return json.dumps(self.trainer_state(cfg, step), indent=2, sort_keys=True) + "\n"


def model_card(cfg: CardSettings, *, base_model: str, adapter_dir: str | Path, step: int, version: int,
               evaluation: dict | None) -> str:
    """The README.md of an adapter directory: the hub's metadata block (base model, `library_name: peft`), then what
    was trained on what (dataset, reward functions, steps), the last evaluation's figures and how to load it."""
    weights = cfg.reward_weights or [None] * len(cfg.reward_funcs or [])
    reward_lines = [f"  - `{reward_name(ref)}`" + (f" (weight {w:g})" if w is not None else "")
                    for ref, w in zip(cfg.reward_funcs or [], weights)]
    if cfg.environment_factory:
        reward_lines.append(f"  - `{cfg.environment_factory}`'s get_reward()")
    dataset = f"`{cfg.dataset_name}`" + (f" (config `{cfg.dataset_config}`)" if cfg.dataset_config else "") + \
        (f", split `{cfg.dataset_train_split}`" if cfg.dataset_name not in ("toy", "environment") else "")
    held_out = f"`{cfg.eval_dataset}`" if cfg.eval_dataset else \
        f"`{cfg.dataset_name}` split `{cfg.dataset_test_split}`"
    figures = _evaluation_lines(evaluation, held_out)
    path = str(Path(adapter_dir).resolve())
    return "\n".join([
        "---",
        f"base_model: {json.dumps(base_model)}",
        "library_name: peft",
        "tags: [asyncgrpo, grpo, lora, reinforcement-learning]",
        "---",
        "",
        f"# {Path(path).name}",
        "",
        f"A LoRA adapter (rank {cfg.lora_r}, alpha {cfg.lora_alpha:g}) of `{base_model}`, trained with GRPO by "
        f"asyncgrpo {__version__}.",
        "",
        f"- **Base model:** `{base_model}`",
        f"- **Dataset:** {dataset}",
        "- **Reward functions:**" + ("" if reward_lines else " none named"),
        *reward_lines,
        f"- **Steps:** {step} optimizer steps of {cfg.max_steps} (policy version {version}), learning rate "
        f"{cfg.learning_rate:g}, {cfg.num_generations} completions per prompt",
        "",
        "## Last evaluation",
        "",
        *figures,
        "",
        "## How to load",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        "",
        f"base = AutoModelForCausalLM.from_pretrained({base_model!r})",
        f"model = PeftModel.from_pretrained(base, {path!r})",
        "```",
        "",
        f"On a vLLM server: `vllm serve {base_model} --enable-lora --max-lora-rank {cfg.lora_r} "
        f"--lora-modules policy={path}`.",
        "",
    ])


def _evaluation_lines(evaluation: dict | None, held_out: str) -> list[str]:
    """A table of the last evaluation's figures (`log_history` names) on `held_out`, or the reason there is none."""
    if not evaluation:
        return ["None ran (`eval_strategy: no`, or none before this step)."]
    rows = [f"| `{k}` | {v:.4f} |" for k, v in sorted(evaluation.items()) if k.startswith("eval_")]
    return [f"At step {evaluation.get('step')}, on {held_out} (completions sampled at the training temperature):", "", "| metric | value |", "| --- | --- |",
            *rows]
