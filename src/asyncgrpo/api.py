"""The Python API, with TRL's GRPOTrainer arguments: `AsyncGRPOTrainer(model, reward_funcs, args=AsyncGRPOConfig(...),
train_dataset=ds, peft_config=LoraConfig(...)).train()`, run on every rank of a launch (`accelerate launch script.py`,
`torchrun`, `deepspeed`). It turns the objects into the config's plain values (objects.py: references; datasets: a
`save_to_disk` directory in output_dir) and runs the recipe (trainer/recipe.py). `asyncgrpo train` runs it too.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from asyncgrpo.config import TOY_REWARD, AsyncGRPOConfig, raise_all, read_values, trl_notice
from asyncgrpo.errors import ConfigError
from asyncgrpo.objects import crossing_problems, reference, rerunning_script

if TYPE_CHECKING:  # heavy: transformers; train() returns one, building the trainer needs none
    from transformers.trainer_utils import TrainOutput

# PEFT LoraConfig fields and the config keys they set; every other field must keep PEFT's default (`_lora_values`).
LORA_KEYS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
             "target_modules": "lora_target_modules"}
LORA_IGNORED = ("task_type", "peft_type", "base_model_name_or_path", "revision", "inference_mode", "peft_version",
                "auto_mapping", "exclude_modules")  # asyncgrpo sets these itself (CAUSAL_LM, the multimodal towers)
# What `model_name_or_path: toy` fills in when left out; a value given to the trainer replaces it without a conflict.
TOY_DEFAULTS = {"dataset_name": "toy", "reward_funcs": [TOY_REWARD]}
# TRL arguments asyncgrpo has no counterpart for, and what to do instead.
NOT_SUPPORTED = {
    "reward_processing_classes": "leave it None: a reward model loads the tokenizer saved in its own directory",
    "optimizers": "leave it (None, None): asyncgrpo builds AdamW over the LoRA weights (learning_rate, weight_decay, "
                  "adam_beta1/2) and the schedule (lr_scheduler_type, warmup_steps)",
    "rollout_func": "leave it None: give `tools` or an `environment_factory` for multi-turn episodes "
                    "(docs/agents.md)",
}


class AsyncGRPOTrainer:
    """TRL's GRPOTrainer arguments; `train()` runs the whole run on this rank and returns a transformers
    `TrainOutput`, as TRL's does (its metrics: run_summary.json's contents on rank 0). Each argument may also come from
    `args` (its config key); giving both is an error. docs/python-api.md."""

    def __init__(self, model=None, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        if rerunning_script():
            raise ConfigError("AsyncGRPOTrainer", "was built while a child process (reward workers, the rollout "
                              "process) ran the launched script again to import the functions it defines",
                              'put the code that builds and trains under `if __name__ == "__main__":`')
        for name, value in (("reward_processing_classes", reward_processing_classes),
                            ("optimizers", None if optimizers == (None, None) else optimizers),
                            ("rollout_func", rollout_func)):
            if value is not None:
                raise ConfigError(name, "is not supported by asyncgrpo", NOT_SUPPORTED[name])
        args = args if args is not None else AsyncGRPOConfig(output_dir=default_output_dir(model))
        self._datasets = {}  # config key -> the Dataset rank 0 writes there before training (train())
        given = {"model_name_or_path": _model_name(model), "reward_funcs": _listed(reward_funcs, "reward_funcs"),
                 "tools": _listed(tools, "tools"),
                 "environment_factory": None if environment_factory is None else reference(environment_factory,
                                                                                            "environment_factory"),
                 "dataset_name": self._dataset_value("dataset_name", train_dataset, args.output_dir),
                 "eval_dataset": self._dataset_value("eval_dataset", eval_dataset, args.output_dir)}
        values = {key: value for key, value in given.items() if value not in (None, [])}
        if "environment_factory" in values and train_dataset is None and args.dataset_name in (None, "toy"):
            values["dataset_name"] = "environment"  # TRL: no dataset, reset() gives each episode's prompt
        raise_all([ConfigError(key, f"is given twice: {value!r} to the trainer and {getattr(args, key)!r} in args",
                               "give it in one place") for key, value in values.items()
                   if getattr(args, key) not in (None, [], value, TOY_DEFAULTS.get(key))])
        values.update(_lora_values(peft_config, values.get("model_name_or_path", args.model_name_or_path)))
        self.args = dataclasses.replace(args, **values)  # every value and combination checked again
        raise_all(self.args.task_problems() + crossing_problems(self.args) + _tokenizer_problems(
            processing_class, self.args))
        self.processing_class = processing_class
        self.callbacks = list(callbacks or [])

    def _dataset_value(self, key: str, data, output_dir: str) -> str | None:
        """A name or path as it is; a `datasets.Dataset`: the directory rank 0 saves it to (read by `dataset_name` /
        `eval_dataset` as any `save_to_disk` directory, there or in the rollout process)."""
        if data is None or isinstance(data, (str, os.PathLike)):
            return None if data is None else str(data)
        kind = type(data).__name__
        if kind != "Dataset" or not hasattr(data, "save_to_disk"):
            fix = {"DatasetDict": "pass one split, e.g. ds['train']", "dict": "pass one Dataset",
                   "IterableDataset": "materialise it (Dataset.from_generator / from_list) or save it to files and "
                                      "pass their path"}.get(kind, "pass a datasets.Dataset, or a file / hub name")
            raise ConfigError("train_dataset" if key == "dataset_name" else key, f"is a {kind}", fix)
        self._datasets[key] = data
        return str(Path(output_dir).resolve() / "datasets" / ("train" if key == "dataset_name" else "eval"))

    def train(self) -> TrainOutput:
        """Run on this rank: write the datasets (rank 0), set up, train, save, clean up. Returns
        `TrainOutput(global_step, training_loss, metrics)` as TRL's `train()` does (recipe.py's `train`).
        SIGTERM / SIGINT / SIGHUP leave no server paused (exit 143 / 130 / 129), with checkpoints on after saving one
        (docs/checkpoints.md)."""
        # heavy: the recipe imports torch, which building a trainer and validating its arguments do not need
        from asyncgrpo.shutdown import exit_on_signal
        from asyncgrpo.trainer import recipe

        if os.environ.get("RANK", "0") == "0":
            for key, data in self._datasets.items():
                _save_dataset(data, Path(getattr(self.args, key)))
        run = recipe.GRPORecipe(self.args, callbacks=self.callbacks, tokenizer=self.processing_class)
        with exit_on_signal(run.halt, defer=run.stop_requested.set, grace_s=run.stop_grace_s):
            try:
                run.setup()
                return run.train()
            finally:
                run.cleanup()


def parse_args(argv: list[str] | None = None, **defaults) -> AsyncGRPOConfig:
    """The config a script's command line asks for, as TRL's `TrlParser(GRPOConfig).parse_args_and_config()`:
    `--config FILE` (YAML, TRL's names too) and `--key value` overrides on top of `defaults`. The keys the script
    passes as objects (model, reward_funcs, datasets) may be left out; the trainer checks them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in argv if not a.startswith("--local_rank")]  # the deepspeed launcher's; LOCAL_RANK says it
    path = None
    if "--config" in argv:
        i = argv.index("--config")
        path, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    values = {**defaults, **read_values(path, argv)}
    notice = trl_notice(values)
    if notice and os.environ.get("RANK", "0") == "0":  # once per launch: every rank parses the same line
        print(f"asyncgrpo: {notice}", file=sys.stderr, flush=True)
    return AsyncGRPOConfig.from_dict(values, require_task=False)


def default_output_dir(model) -> str:
    """TRL's default: `<model's last name part>-GRPO`."""
    name = Path(str(model)).name if isinstance(model, (str, os.PathLike)) and str(model) else "asyncgrpo"
    return f"{name}-GRPO"


def _model_name(model) -> str | None:
    if model is None or isinstance(model, (str, os.PathLike)):
        return None if model is None else str(model)
    named = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    raise ConfigError("model", f"is a loaded {type(model).__name__}; asyncgrpo loads the base on every rank itself "
                      "(sharded by the backend) and the vLLM server serves that same base",
                      f"pass its hub id or directory{f' (this one says {named!r})' if named else ''}, e.g. "
                      "model='Qwen/Qwen2.5-1.5B-Instruct'")


def _listed(items, key: str) -> list[str] | None:
    """One or several functions / classes / `module:name` strings -> their references (objects.py)."""
    if items is None:
        return None
    items = items if isinstance(items, (list, tuple)) else [items]
    for item in items:
        if hasattr(item, "config") and hasattr(item, "forward"):  # a loaded reward model
            raise ConfigError(key, f"holds a loaded {type(item).__name__}", "pass the reward model's directory "
                              "(a string): asyncgrpo loads it in the process that scores")
    return [reference(item, key) for item in items]


def _lora_values(peft_config, model: str | None) -> dict:
    """The config keys a PEFT LoraConfig sets; a field asyncgrpo cannot honour (DoRA, rsLoRA, bias, ...) is an
    error naming it. `target_modules=None` is PEFT's default for the model's type, as PEFT would pick."""
    if peft_config is None:
        return {}
    from peft import LoraConfig  # heavy: peft; the caller built a LoraConfig, so it is loaded already

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError("peft_config", f"is a {type(peft_config).__name__}; asyncgrpo trains LoRA adapters",
                          "pass a peft.LoraConfig")
    default = LoraConfig()
    changed = [f.name for f in dataclasses.fields(LoraConfig) if f.name not in LORA_KEYS
               and f.name not in LORA_IGNORED and getattr(peft_config, f.name) != getattr(default, f.name)]
    if changed:
        raise ConfigError("peft_config", f"sets {', '.join(changed)}, which asyncgrpo does not train (the vLLM "
                          "server loads plain LoRA: rank, alpha, dropout, target modules)",
                          f"leave {', '.join(changed)} at PEFT's default")
    if str(peft_config.task_type or "CAUSAL_LM") not in ("CAUSAL_LM", "TaskType.CAUSAL_LM"):
        raise ConfigError("peft_config", f"task_type is {peft_config.task_type}", "use task_type='CAUSAL_LM'")
    targets = peft_config.target_modules
    if targets is None:
        targets = _peft_default_targets(model)
    targets = [targets] if isinstance(targets, str) else sorted(targets)
    return {"lora_r": peft_config.r, "lora_alpha": float(peft_config.lora_alpha),
            "lora_dropout": float(peft_config.lora_dropout), "lora_target_modules": targets}


def _peft_default_targets(model: str | None) -> list[str]:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    from asyncgrpo.data import model_type_of  # heavy: transformers' AutoConfig

    kind = model_type_of(model) if model and Path(model).is_dir() else None
    if kind not in DEFAULTS:
        raise ConfigError("peft_config", f"leaves target_modules unset, and PEFT's default for {model!r} could not be "
                          f"read here (model type {kind})", "set target_modules, e.g. ['q_proj', 'v_proj'] or "
                          "'all-linear'")
    return list(DEFAULTS[kind])


def _tokenizer_problems(tokenizer, cfg: AsyncGRPOConfig) -> list[ConfigError]:
    """A tokenizer object is used in the training processes; the processes that load their own from the model
    directory would not see it."""
    where = [name for name, on in (("reward_workers", cfg.reward_workers > 0), ("rollout_process", cfg.rollout_process),
                                   ("rollout_address", bool(cfg.rollout_address))) if on]
    if tokenizer is None or not where:
        return []
    return [ConfigError("processing_class", f"is given, but with {', '.join(where)} another process loads the "
                        "tokenizer from the model directory and would not use this one", "save it into a copy of the "
                        "model directory (tokenizer.save_pretrained(DIR)) and pass that directory as `model`, or "
                        "leave processing_class None")]


def _save_dataset(data, path: Path) -> None:
    """Write `data` to `path` (`save_to_disk`) through a temporary sibling, replacing what a previous run left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    data.save_to_disk(str(partial))
    if path.exists():
        shutil.rmtree(path)
    partial.rename(path)
