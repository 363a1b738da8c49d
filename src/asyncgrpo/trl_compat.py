"""TRL's GRPOConfig (and transformers' TrainingArguments) names, read into this project's config keys.

`translate(values)` takes a raw mapping (a YAML file plus overrides) and returns it in this project's names, with
one ConfigError per TRL key whose value asyncgrpo cannot honour, so that a file is corrected in one go. The tables
below are the reference for docs/configuration.md#trl-keys (a unit test checks that the page lists every key).
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path

from asyncgrpo.errors import ConfigError

# TRL / transformers name -> this project's key, with the same meaning.
ALIASES = {
    "use_peft": "use_lora",
    "dtype": "torch_dtype",  # TRL's ModelConfig and transformers 5 (`from_pretrained(dtype=...)`)
    "vllm_importance_sampling_clip_max": "vllm_importance_sampling_cap",  # TRL renamed `_cap` to `_clip_max`
}

_SERVER = ("start a vLLM server (launch/vllm/serve.sh, or `python -m asyncgrpo.inference_node.vllm_server`) and give its URL "
           "in vllm_server_base_url")
# Keys accepted when their value is what asyncgrpo does anyway: key -> (the values that agree, why, what to use).
AGREEING = {
    "use_vllm": ((True,), "asyncgrpo always generates on vLLM servers", _SERVER),
    "vllm_mode": (("server",), "asyncgrpo generates on separate vLLM servers; it cannot run vLLM inside the training "
                  "processes (colocate)", f"set `vllm_mode: server`, {_SERVER}"),
    "remove_unused_columns": ((False,), "every dataset column reaches the reward functions",
                              "set `remove_unused_columns: false`, or drop the columns from the data"),
    "shuffle_dataset": ((True,), "prompts are always drawn in a seeded shuffled order", "remove it"),
    "logging_strategy": (("steps",), "metrics are logged every `logging_steps` optimizer steps",
                         "set `logging_strategy: steps`"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "the optimizer is torch's AdamW over the LoRA weights",
              "set `optim: adamw_torch`"),
    "adam_epsilon": ((1e-8,), "AdamW runs with torch's default epsilon 1e-8", "set `adam_epsilon: 1.0e-8`"),
    "lora_task_type": (("CAUSAL_LM",), "adapters are trained on causal language models", "remove it"),
    "use_rslora": ((False,), "adapters use the standard alpha / r scaling, as the vLLM servers do", "remove it"),
    "use_dora": ((False,), "vLLM does not serve DoRA adapters", "remove it"),
    "trust_remote_code": ((False,), "models are loaded with transformers' own code only", "remove it"),
    "model_revision": (("main",), "a hub model is loaded at its default revision",
                       "download that revision and give its local directory in model_name_or_path"),
    "sync_ref_model": ((False,), "the KL reference is the base model (the adapter switched off), never updated",
                       "remove it"),
    "multi_objective_aggregation": (("sum_then_normalize",), "rewards are summed with `reward_weights`, then "
                                    "normalised in each group", "remove it"),
    "top_k": ((0, -1, None), "the loss scores the full distribution: the server samples from all of it",
              "remove it"),
    "min_p": ((None, 0, 0.0), "the loss scores the full distribution: the server samples from all of it",
              "remove it"),
    "repetition_penalty": ((1, 1.0), "a penalty would make the server sample from another distribution than the "
                           "one the trainer scores", "remove it"),
    "push_to_hub": ((False,), "asyncgrpo does not upload", "upload `output_dir` yourself (`hf upload REPO DIR`)"),
    "use_liger_kernel": ((False,), "the loss computes logprobs of the sampled tokens in chunks itself", "remove it"),
    "gradient_checkpointing_kwargs": ((None, {}, {"use_reentrant": False}),
                                      "gradient checkpointing is always non-reentrant", "remove it"),
    "generation_kwargs": ((None, {}), "sampling settings other than temperature are sent at their neutral values",
                          "remove it"),
    "lr_scheduler_kwargs": ((None, {}), "the schedules take no extra arguments", "remove it"),
}
# Keys with no effect here whatever their value: TRL reads them only where asyncgrpo does something else.
IGNORED = {
    "vllm_gpu_memory_utilization": "colocate mode only; give the server its own `--gpu-memory-utilization`",
    "vllm_tensor_parallel_size": "colocate mode only; give the server its own `--tensor-parallel-size`",
    "vllm_enable_sleep_mode": "colocate mode only",
    "vllm_max_model_length": "colocate mode only; the server's `--max-model-len` is read from /v1/models",
    "vllm_model_impl": "colocate mode only; give the server its own `--model-impl`",
    "vllm_group_port": "TRL's weight-transfer port; asyncgrpo publishes adapter files instead",
    "do_train": "transformers does not read it either",
    "do_eval": "transformers does not read it either",
    "disable_tqdm": "the progress bar is rank 0's alone",
    "log_level": "asyncgrpo logs at INFO",
    "hub_model_id": "read only with push_to_hub, which is false",
    "hub_strategy": "read only with push_to_hub, which is false",
    "hub_private_repo": "read only with push_to_hub, which is false",
    "dataloader_num_workers": "prompts are read by the rollout side, not a DataLoader",
    "dataloader_pin_memory": "prompts are read by the rollout side, not a DataLoader",
    "dataloader_persistent_workers": "prompts are read by the rollout side, not a DataLoader",
    "ddp_find_unused_parameters": "only LoRA weights train, and every one is used",
}
# TRL / transformers keys read here that are booleans (a command line may give them alone: `--bf16`).
BOOLEAN_KEYS = frozenset({"bf16", "fp16", "do_train", "do_eval", "disable_tqdm", "dataloader_pin_memory",
                          "dataloader_persistent_workers", "ddp_find_unused_parameters"} |
                         {key for key, (agree, _, _) in AGREEING.items() if all(type(v) is bool for v in agree)})
SAVE_STEPS_DEFAULT = 500  # transformers' save_steps, used by `save_strategy: steps` without save_steps
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def translate(values: dict) -> tuple[dict, list[ConfigError]]:
    """`values` in this project's key names, and the problems found on the way (one per key)."""
    values, problems = dict(values), []
    _renames(values, problems)
    for key, (agree, why, fix) in AGREEING.items():
        value = values.pop(key, agree[0])
        if value not in agree:
            shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as YAML writes it
            problems.append(ConfigError(key, f"{shown} cannot be honoured: {why}", fix))
    for key in IGNORED:
        values.pop(key, None)
    for step in (_model_init_kwargs, _precision, _save_strategy, _epochs, _resume, _server_address, _tool_iterations,
                 _reward_paths, _environment):
        try:
            step(values)
        except ConfigError as exc:
            problems.append(exc)
    return values, problems


def _renames(values: dict, problems: list[ConfigError]) -> None:
    for trl, ours in ALIASES.items():
        if trl not in values:
            continue
        value = values.pop(trl)
        if ours in values and values[ours] != value:
            problems.append(ConfigError(trl, f"is {value!r} but `{ours}` (the same key under this project's name) is "
                                        f"{values[ours]!r}", "keep one of them"))
        else:
            values[ours] = value


def _precision(values: dict) -> None:
    """`bf16: true` / `fp16: true` (mixed precision in transformers): here, the base model in that dtype, LoRA and
    loss in fp32 (`torch_dtype`)."""
    wanted = [_DTYPES[key] for key in _DTYPES if values.pop(key, False) is True]
    if len(wanted) > 1:
        raise ConfigError("bf16", "and fp16 are both true", "keep one of them (bf16 on GPUs that have it)")
    if not wanted:
        return
    given = values.setdefault("torch_dtype", wanted[0])
    if given != wanted[0]:
        key = "bf16" if wanted[0] == "bfloat16" else "fp16"
        raise ConfigError(key, f"true asks for {wanted[0]} autocast over {given} weights; asyncgrpo's half precision "
                          f"is the base model held in {wanted[0]} with the LoRA weights and the loss in fp32",
                          f"set `dtype: {wanted[0]}`, or `{key}: false` to train in {given}")


def _model_init_kwargs(values: dict) -> None:
    kwargs = values.pop("model_init_kwargs", None) or {}
    if not isinstance(kwargs, dict):
        raise ConfigError("model_init_kwargs", f"is {kwargs!r}, not a mapping", "write `{dtype: bfloat16}`")
    other = sorted(set(kwargs) - {"dtype", "torch_dtype"})
    if other:
        raise ConfigError("model_init_kwargs", f"sets {', '.join(other)}, which asyncgrpo does not pass to "
                          f"from_pretrained (it takes only the dtype)", "remove them; give the dtype as `dtype: ...`")
    for key in ("dtype", "torch_dtype"):
        if key in kwargs:
            values.setdefault("torch_dtype", kwargs[key])


def _save_strategy(values: dict) -> None:
    strategy = values.pop("save_strategy", None)
    if strategy is None:
        return
    if strategy == "no":
        values["save_steps"] = 0
    elif strategy == "steps":
        values.setdefault("save_steps", SAVE_STEPS_DEFAULT)
    else:
        raise ConfigError("save_strategy", f"{strategy!r} is not supported: checkpoints are taken every save_steps "
                          "optimizer steps", "set `save_strategy: steps` with `save_steps: N` (or `no`)")


def _epochs(values: dict) -> None:
    """transformers: `max_steps` > 0 overrides `num_train_epochs`; `max_steps: -1` means "use the epochs"."""
    if values.get("max_steps") == -1:
        del values["max_steps"]
        if values.get("num_train_epochs") is None:
            raise ConfigError("max_steps", "is -1 (run num_train_epochs) but num_train_epochs is not set",
                              "set `num_train_epochs: N` or a positive max_steps")
    elif "max_steps" in values:
        values.pop("num_train_epochs", None)


def _resume(values: dict) -> None:
    """`resume_from_checkpoint: true` (transformers: the newest checkpoint in output_dir) is `latest` here."""
    value = values.get("resume_from_checkpoint")
    if value is True:
        values["resume_from_checkpoint"] = "latest"
    elif value is False:
        values["resume_from_checkpoint"] = None


def _server_address(values: dict) -> None:
    """TRL's `vllm_server_host` + `vllm_server_port` (read when vllm_server_base_url is unset)."""
    host, port = values.pop("vllm_server_host", None), values.pop("vllm_server_port", None)
    if (host is not None or port is not None) and "vllm_server_base_url" not in values:
        host = "127.0.0.1" if host in (None, "0.0.0.0") else host  # TRL's default host: this machine
        values["vllm_server_base_url"] = f"http://{host}:{port or 8000}"


def _tool_iterations(values: dict) -> None:
    """TRL's `max_tool_calling_iterations` counts tool rounds (unset: no cap); `max_turns` counts model turns."""
    rounds = values.pop("max_tool_calling_iterations", None)
    if rounds is None:
        return
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise ConfigError("max_tool_calling_iterations", f"is {rounds!r}, not a whole number >= 0",
                          "give the most tool rounds an episode may take, e.g. 7 (or max_turns: 8)")
    if values.get("max_turns", rounds + 1) != rounds + 1:
        raise ConfigError("max_tool_calling_iterations", f"is {rounds} (at most {rounds + 1} model turns) but "
                          f"max_turns is {values['max_turns']}", "set only one of them")
    values["max_turns"] = rounds + 1


def _environment(values: dict) -> None:
    """TRL's `env:` mapping (TrlParser): environment variables, set by `apply_environment` before the run starts."""
    environment_variables(values.pop("env", None))


def environment_variables(env) -> dict[str, str]:
    """`env:` as {name: value}; anything but a mapping of names is an error naming the fix."""
    if env is None:
        return {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and k for k in env):
        raise ConfigError("env", f"is {env!r}, not a mapping of variable names to values",
                          "write `env: {NAME: value}`, one entry per environment variable")
    return {name: "" if value is None else str(value) for name, value in env.items()}


def apply_environment(values: dict) -> None:
    """Set the variables of TRL's `env:` mapping in this process, as TRL's parser does when it reads the file."""
    os.environ.update(environment_variables(values.get("env")))


def _reward_paths(values: dict) -> None:
    """TRL's reward function names: a dotted path `pkg.module.function` is `pkg.module:function` here, and TRL's
    built-in names (`accuracy_reward`, ...) are its `trl.rewards` functions."""
    funcs = values.get("reward_funcs")
    if isinstance(funcs, str) and "," not in funcs:
        funcs = [funcs]
    if not isinstance(funcs, list):
        return
    values["reward_funcs"] = [_reward_path(f) if isinstance(f, str) else f for f in funcs]


TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")  # `trl grpo`'s built-in names


def _reward_path(name: str) -> str:
    """TRL's `pkg.module.function` as `pkg.module:function`. Only a dotted Python name is one: an entry with a `/`
    (`/nfs/rm.v2/ckpt`, `Skywork/Skywork-Reward-V2-Qwen3-0.6B`), a `-`, or an existing path is a reward model and
    stays as written."""
    if name in TRL_REWARDS:
        return f"trl.rewards:{name}"
    parts = name.split(".")
    if ":" in name or len(parts) < 2 or not all(p.isidentifier() for p in parts) or Path(name).exists():
        return name  # ours, a reward model, or a bare name that config validation reports
    module, _, function = name.rpartition(".")
    return f"{module}:{function}"


# TRL / transformers keys with no equivalent here: unknown, but never answered with a look-alike key of another
# meaning (`per_device_eval_batch_size` is not `per_device_train_batch_size`).
TRL_ONLY = frozenset("""
attn_implementation bf16_full_eval cache_implementation cast_lm_head_to_fp32 data_seed dataset_streaming
disable_dropout entropy_coef eval_on_start fp16_full_eval fsdp fsdp_config
generation_batch_size label_names load_best_model_at_end load_in_4bit load_in_8bit log_completions_hub_repo
log_unique_prompts logging_dir lora_modules_to_save lora_target_parameters metric_for_best_model
overwrite_output_dir pad_to_multiple_of per_device_eval_batch_size ref_model_mixup_alpha ref_model_sync_steps
reward_model_name_or_path router_aux_loss_coef save_on_each_node save_only_model steps_per_generation tf32
torch_compile use_cpu use_transformers_paged vllm_structured_outputs_regex
""".split())
# difflib's ratio: `learning_rat` -> `learning_rate` is 0.96, `num_train_epochs` -> `num_iterations` only 0.67.
SUGGEST_CUTOFF = 0.85


def unknown_key(key: str, known) -> ConfigError:
    """The error for a key neither this project nor the TRL layer knows, with a suggestion only when it is close."""
    if key in TRL_ONLY:
        return ConfigError(key, "is a TRL/transformers key asyncgrpo has no equivalent for",
                           "remove it (docs/configuration.md#trl-keys lists the TRL keys asyncgrpo reads)")
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=SUGGEST_CUTOFF)
    return ConfigError(key, "unknown key", f"did you mean `{close[0]}`?" if close else
                       "remove it (docs/configuration.md lists every key, and #trl-keys the TRL names it reads)")


# Every key of this project that TRL (GRPOConfig, its ModelConfig and `trl grpo`'s script arguments) or transformers'
# TrainingArguments has under the same name (`--help` and docs/configuration.md say so beside each key).
SAME_NAME = frozenset("""
model_name_or_path lora_r lora_alpha lora_dropout lora_target_modules dataset_name dataset_config dataset_train_split
dataset_test_split data_files chat_template_kwargs reward_funcs reward_weights num_generations max_completion_length
temperature top_p per_device_train_batch_size gradient_accumulation_steps learning_rate lr_scheduler_type warmup_steps
weight_decay adam_beta1 adam_beta2 max_grad_norm max_steps num_train_epochs num_iterations epsilon epsilon_high delta
loss_type sapo_temperature_pos sapo_temperature_neg importance_sampling_level vllm_importance_sampling_correction
vllm_importance_sampling_mode vllm_importance_sampling_cap vllm_importance_sampling_clip_min off_policy_mask_threshold
use_bias_correction_kl top_entropy_quantile beta scale_rewards mask_truncated_completions seed gradient_checkpointing
vllm_server_base_url vllm_server_timeout output_dir logging_steps report_to run_name log_completions
num_completions_to_print eval_strategy eval_steps num_generations_eval save_steps save_total_limit
resume_from_checkpoint deepspeed ddp_timeout
""".split())
# Keys TRL sets under other names or spellings, and how they are read (the `translate` steps above).
OTHER_NAMES = {
    "torch_dtype": "`dtype`, `model_init_kwargs: {dtype: X}`, `bf16: true` (bfloat16), `fp16: true` (float16)",
    "use_lora": "`use_peft`",
    "vllm_importance_sampling_cap": "`vllm_importance_sampling_clip_max` (also this name, TRL's old one)",
    "save_steps": "the same name; `save_strategy: no` is 0, `save_strategy: steps` without save_steps is 500",
    "vllm_server_base_url": "the same name; `vllm_server_host` + `vllm_server_port` when it is not given",
    "max_turns": "`max_tool_calling_iterations: N` (tool rounds) is `max_turns: N + 1`",
    "resume_from_checkpoint": "the same name; `true` is `latest`, `false` unset",
    "max_steps": "the same name; `-1` runs `num_train_epochs`",
    "warmup_ratio": "the same name in transformers 4 (transformers 5 takes a fraction in `warmup_steps`)",
    "reward_funcs": "the same name; a dotted `pkg.module.function` is `pkg.module:function`, and TRL's built-in "
                    "names (`accuracy_reward`, ...) are `trl.rewards:<name>`",
}


def trl_name(key: str) -> str:
    """What a TRL user writes for `key`: its TRL name(s), or that TRL has none."""
    if key in OTHER_NAMES:
        return OTHER_NAMES[key]
    return "the same name" if key in SAME_NAME else "none (asyncgrpo's own key)"


# ---- defaults that differ from TRL's ---------------------------------------------------------------------------
# Keys whose presence marks a file as written for TRL (its own names, the keys it reads differently, its booleans).
TRL_STYLE_KEYS = frozenset({*ALIASES, *AGREEING, *IGNORED, *BOOLEAN_KEYS, "model_init_kwargs", "save_strategy",
                            "vllm_server_host", "vllm_server_port", "max_tool_calling_iterations", "env"})


class TrlDefault(typing.NamedTuple):
    """One default that differs from TRL's: TRL's value as a TRL user writes it, why asyncgrpo keeps its own, and
    the keys (ours and TRL's) that set it, so that a file that sets one of them is not told about it."""

    trl: str
    why: str
    keys: tuple[str, ...]


# Our key -> how TRL's default differs (TRL's GRPOConfig and ModelConfig, transformers' TrainingArguments). The one
# source of docs/configuration.md#defaults-that-differ-from-trls and of the note a TRL-style config gets at start.
TRL_DEFAULTS = {
    "torch_dtype": TrlDefault("`bf16: true` (bf16 autocast over the checkpoint's dtype)", "the CPU hosts and the toy "
                              "train in fp32, and 16 bits here means the base held in bf16 with the LoRA weights and "
                              "the loss in fp32, not autocast; the GPU recipes set `torch_dtype: bfloat16`",
                              ("torch_dtype", "dtype", "bf16", "fp16", "model_init_kwargs")),
    "gradient_checkpointing": TrlDefault("`true`", "a LoRA run of a small model keeps its activations and saves the "
                                         "extra forward; the GPU recipes turn it on",
                                         ("gradient_checkpointing",)),
    "learning_rate": TrlDefault("`1e-6`", "TRL's rate is sized for full fine-tuning; asyncgrpo trains LoRA adapters "
                                "only, which take a rate about 10x higher", ("learning_rate",)),
    "max_steps": TrlDefault("`-1` with `num_train_epochs: 3`", "a length left out should not mean three passes over a "
                            "large dataset; 100 steps is a short run that shows whether the reward moves "
                            "(`num_train_epochs: 3` gives TRL's)", ("max_steps", "num_train_epochs")),
    "save_steps": TrlDefault("`500`", "a checkpoint holds the optimizer, RNG states and data position, and a run "
                             "that saves also saves its last step, so a run asks for them; the interval must be a "
                             "multiple of num_iterations and weight_sync_steps, which 500 often is not",
                             ("save_steps", "save_strategy")),
    "seed": TrlDefault("`42`", "the figures in docs/ (benchmarks, staleness, agents) were measured at seed 0 and "
                       "reproduce at the default", ("seed",)),
    "delta": TrlDefault("unset (no bound)", "training is asynchronous by default (max_staleness 1): without a bound a "
                        "token far more likely under the trainer than under the sampler weighs without limit "
                        "(docs/losses.md)", ("delta",)),
    "vllm_importance_sampling_correction": TrlDefault("`true`", "measured on the toy, the correction did not beat the "
                                                      "clip against the sampler's logprobs up to max_staleness 8, and "
                                                      "with num_iterations 1 it drops the clip's trust region "
                                                      "(docs/losses.md)", ("vllm_importance_sampling_correction",)),
    "vllm_importance_sampling_mode": TrlDefault("`sequence_mask`", "read only with the correction on (off by "
                                                "default); token_truncate is the mode measured in docs/losses.md",
                                                ("vllm_importance_sampling_mode",)),
    "use_lora": TrlDefault("`use_peft: false`", "asyncgrpo trains LoRA adapters only: the servers are sent adapters, "
                           "never full weights", ("use_lora", "use_peft")),
    "lora_r": TrlDefault("`16`", "every server loads the adapter at every sync: a smaller one is faster to publish "
                         "(raise it for capacity, up to the server's --max-lora-rank)", ("lora_r",)),
    "lora_alpha": TrlDefault("`32`", "2 x lora_r, the same scale as TRL's pair", ("lora_alpha",)),
    "lora_dropout": TrlDefault("`0.05`", "dropout makes the trainer's policy differ from the one the server samples "
                               "with; 0 keeps them equal", ("lora_dropout",)),
    "lora_target_modules": TrlDefault("unset: PEFT's choice for the architecture (`q_proj`, `v_proj` for Qwen2 and "
                                      "Llama)", "every attention and MLP projection, as the recipes train; PEFT's "
                                      "choice adapts two", ("lora_target_modules",)),
    "logging_steps": TrlDefault("`10`", "an asynchronous run is watched step by step (staleness, sync times), and a "
                                "write per step costs little", ("logging_steps",)),
    "per_device_train_batch_size": TrlDefault("`8`", "a batch holds whole groups (a multiple of num_generations, 8): "
                                              "64 is 8 prompts of 8 completions per rank",
                                              ("per_device_train_batch_size",)),
    "max_completion_length": TrlDefault("`512`", "sized for the toy and CPU hosts; the GSM8K recipes set 512",
                                        ("max_completion_length",)),
    "report_to": TrlDefault("`none`", "metrics are how an asynchronous run is watched; TensorBoard writes local files "
                            "and needs no account", ("report_to",)),
    "output_dir": TrlDefault("`trainer_output`", "a directory named after the project, under runs/", ("output_dir",)),
    "ddp_timeout": TrlDefault("`1800`", "it must exceed rank 0's longest wait with the default timeouts (a batch, a "
                              "sync through a server outage, adapter uploads), which 1800 s does not",
                              ("ddp_timeout",)),
}


def trl_style_keys(values: dict) -> list[str]:
    """The keys of a raw mapping (before `translate`) that only a TRL config writes; empty for one of ours."""
    return sorted(key for key in values if key in TRL_STYLE_KEYS)


def default_differences(values: dict, ours: dict) -> list[str]:
    """For a TRL-style mapping: one line per default it leaves out that differs from TRL's (`ours`: our defaults by
    key); empty for a file of ours or one that sets every such key."""
    if not trl_style_keys(values):
        return []
    return [f"{key}: {ours[key]!r} (TRL: {entry.trl}): {entry.why}" for key, entry in TRL_DEFAULTS.items()
            if not any(k in values for k in entry.keys)]


def default_notice(values: dict, ours: dict) -> str | None:
    """What a TRL-style config is told once at start: the defaults it gets that TRL would not have given it."""
    lines = default_differences(values, ours)
    if not lines:
        return None
    head = (f"this config is written for TRL ({', '.join(trl_style_keys(values)[:4])}, ...); these keys it leaves out "
            f"take asyncgrpo's defaults, not TRL's (set one to choose; docs/configuration.md#defaults-that-differ-"
            f"from-trls):")
    return "\n".join([head, *(f"  {line}" for line in lines)])


def trl_defaults_markdown(ours: dict) -> str:
    """The table of docs/configuration.md#defaults-that-differ-from-trls."""
    rows = ["| key | asyncgrpo | TRL | why asyncgrpo's |", "| --- | --- | --- | --- |"]
    rows += [f"| `{key}` | `{ours[key]}` | {entry.trl} | {entry.why} |" for key, entry in TRL_DEFAULTS.items()]
    return "\n".join(rows)
