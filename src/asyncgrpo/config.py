"""AsyncGRPOConfig: one typed object for a whole run, read from YAML plus command-line overrides.

Names follow TRL's GRPOConfig where TRL has one. Importable without torch, so a config file can be validated fast:

    asyncgrpo train --config configs/demo.yaml --max_steps 50 --learning_rate 1e-3
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import os
import re
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from asyncgrpo import trl_compat
from asyncgrpo.errors import ConfigError, ConfigErrors
from asyncgrpo.rewards import reward_name
from asyncgrpo.trackers import resolve_report_to

API_KEY_ENV = "ASYNCGRPO_VLLM_API_KEY"
TOY_REWARD = "asyncgrpo.toy:larger_reward"  # the toy world's reward: `reward_funcs`' default with `dataset_name: toy`
ROLLOUT_KEY_ENV = "ASYNCGRPO_ROLLOUT_KEY"  # the key of `rollout_address` connections (transport/remote.py)
AGENT_KEY_ENV = "ASYNCGRPO_AGENT_KEY"  # the key of the agent endpoint when it listens beyond 127.0.0.1 (capture)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Choices of the loss keys (loss.py implements them; listed here so that config stays importable without torch).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SCALE_REWARDS = ("group", "batch", "none")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
TORCH_DTYPES = ("float32", "bfloat16", "float16")
PROMPT_FORMATS = ("auto", "chat", "raw")
EPISODE_VERSIONS = ("pinned", "latest")
SYNC_MODES = ("pause", "versioned")
ROLLOUT_MODES = ("batch", "stream")
SYNC_PAUSE_MODES = ("keep", "wait", "abort")
ADAPTER_DELIVERIES = ("shared_fs", "http")
EVAL_STRATEGIES = ("steps", "no")


# ---- values one at a time (every section's RANGES) ---------------------------------------------
@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: `low`/`high` (None: unbounded), each bound itself allowed unless `*_open`.
    Floats must also be finite: NaN passes every comparison (`nan < 0` is false) and would reach the optimiser."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    fix: str = ""

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts) or "a finite number"

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


_SECONDS = "a positive number of seconds"

# ---- the sections: each key's field, docs, range, choices and checks side by side ------------------
class Section:
    """What every section has: the numeric ranges of its keys, the choices of its string keys, and its checks across
    its own keys (raising the first ConfigError). Checks across sections are AsyncGRPOConfig's."""

    RANGES: ClassVar[dict[str, Range]] = {}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}
    CHOICE_FIX: ClassVar[dict[str, str]] = {}  # a choice key's own wording of the fix; else "use one of ..."

    def value_problems(self) -> list[ConfigError]:
        """This section's values that are wrong alone beyond their range (a name, a URL), one error each."""
        return []

    @classmethod
    def check_choices(cls, cfg) -> None:
        """Raise a ConfigError for the first key whose value is not one of its CHOICES, with the closest one."""
        for key, allowed in cls.CHOICES.items():
            value = getattr(cfg, key)
            if value not in allowed:
                close = difflib.get_close_matches(str(value), allowed, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(key, f"unknown value {value!r}",
                                  cls.CHOICE_FIX.get(key, f"use one of {', '.join(allowed)}") + hint)

    def check(self) -> None:
        """Raise a ConfigError for the first combination of this section's keys that cannot run."""

    @classmethod
    def check_all(cls, cfg) -> None:
        """This section's choices, then its own checks, on `cfg` (this section or a config holding it). Called on
        the class: in the composed config, `cfg.check` would be the first section's only."""
        cls.check_choices(cfg)
        cls.check(cfg)


SectionT = TypeVar("SectionT", bound=Section)


@dataclass
class ModelSettings(Section):
    """The base model and its LoRA adapter. Read by trainer/policy.py, lora.py and the adapter store."""

    model_name_or_path: str | None = None
    """Required. Base model directory (or hub id, for users with hub access). `toy` builds the local toy model
    (asyncgrpo.toy) with the `toy_seed` seed and uses its cached directory, and chooses the toy world: its prompts and
    reward become the defaults of `dataset_name` and `reward_funcs`; `shape:<name>` (e.g.
    `shape:qwen2.5-1.5b`) a random-weight model of a real checkpoint's shape in `torch_dtype` (docs/models.md).
    Every adapter records it as `base_model_name_or_path`: a hub id as written, a local directory as an absolute
    path."""
    toy_seed: int = 0
    """Seed of the toy world, used only when `model_name_or_path: toy` or `dataset_name: toy`."""
    torch_dtype: str = "float32"
    """Dtype the trainer loads the base model in: `float32`, `bfloat16` or `float16`. The LoRA weights stay fp32
    over a half-precision base (PEFT's default), and the loss is computed in fp32. On GPUs use `bfloat16`. TRL's
    `dtype`, `model_init_kwargs: {dtype: ...}`, `bf16: true` and `fp16: true` set it (docs/configuration.md#trl-keys);
    so does a DeepSpeed json whose `bf16.enabled` is on."""
    use_lora: bool = True
    """Train a LoRA adapter on a frozen base (TRL's `use_peft`). Full fine-tuning is not supported yet."""
    lora_adapter_path: str | None = None
    """Directory where published adapter versions are written: `<lora_adapter_path>/<run id>/v000001`, ... (PEFT
    `save_pretrained` format, written atomically). With `adapter_delivery: shared_fs` the inference servers must read
    it at the same path; with `http` it stays on the trainer's side. Unset: `<output_dir>/adapters`."""
    lora_name: str = "policy"
    """Name generation requests use for the trained adapter on the inference server. A run id is appended
    so that names stay unique for the server's lifetime (vLLM refuses to re-load a name)."""
    lora_r: int = 8
    """LoRA rank: higher = more capacity and memory. Must not exceed the server's `--max-lora-rank`."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input during training. Keep 0 for exact trainer/server policy equivalence."""
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names that get a LoRA adapter, or `all-linear` (PEFT's: every linear layer of the language model but
    the output head)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "toy_seed": Range(0, fix="use a seed >= 0, e.g. 0"),
        "lora_r": Range(1, fix="use e.g. 8 or 16 (at most the server's --max-lora-rank)"),
        "lora_alpha": Range(0, low_open=True, fix="use e.g. 2 x lora_r"),
        "lora_dropout": Range(0, 1, high_open=True, fix="use 0 (exact trainer/server equivalence) or e.g. 0.05"),
    }

    def value_problems(self) -> list[ConfigError]:
        if LORA_NAME.fullmatch(self.lora_name):
            return []
        return [ConfigError("lora_name", f"{self.lora_name!r} is not a name every server and file system accepts: "
                            f"letters, digits, `.`, `_` and `-`, starting with a letter or digit, at most 64 "
                            f"characters", "use e.g. `lora_name: policy`")]

    def check(self) -> None:
        if not self.use_lora:
            raise ConfigError("use_lora", "false is not supported yet", "set `use_lora: true`")
        if not self.lora_adapter_path:
            raise ConfigError("lora_adapter_path", "is required when use_lora is true",
                              "set lora_adapter_path to a directory the inference server can read, "
                              "e.g. `lora_adapter_path: runs/demo/adapters`")
        if self.torch_dtype not in TORCH_DTYPES:
            raise ConfigError("torch_dtype", f"unknown dtype {self.torch_dtype!r}", "use float32, bfloat16 or float16 "
                              "(`auto` is not read from the checkpoint: name the dtype)")


@dataclass
class DataSettings(Section):
    """Prompts and rewards. Read by data.py and the rollout side's scoring (rollout/scoring.py, reward_pool.py)."""

    dataset_name: str | None = None
    """Required unless `model_name_or_path: toy`. Prompt source: `toy` (the toy world's training split, whose reward
    then becomes the default of `reward_funcs`); a local data file (`.json`, `.jsonl`, `.parquet`,
    `.csv`, `.arrow`) or a directory written by `Dataset.save_to_disk`; a `datasets` format (`json`, `parquet`,
    `csv`, `arrow`) together with `data_files`; or a Hugging Face hub dataset such as `openai/gsm8k` (needs hub
    access); or `environment`: no dataset, `environment_factory`'s `reset()` returns each episode's prompt (TRL)."""
    dataset_config: str | None = None
    """Configuration (subset) of a hub dataset, e.g. `main` for `openai/gsm8k` (`datasets.load_dataset`'s `name`)."""
    dataset_train_split: str = "train"
    """Split to train on. Local files (a path in `dataset_name`, or `data_files`) are the `train` split."""
    dataset_test_split: str = "test"
    """Split of `dataset_name` that `eval_strategy: steps` evaluates on when `eval_dataset` is not set (TRL's script
    argument, with its default). `toy` has `train` and `test` (its held-out prompts); a local file has only `train`
    (a missing split is an error naming the splits there are)."""
    data_files: list[str] | None = None
    """Local data files for `dataset_name: json | parquet | csv | arrow` (or files picked from a hub dataset)."""
    prompt_column: str = "prompt"
    """Column holding the prompt: plain text, or a list of chat messages (TRL's conversational format). Every other
    column is passed to reward functions by name."""
    messages_column: str | None = None
    """Column holding chat messages (`[{role: user, content: ...}, ...]`) to use as the prompt instead of
    `prompt_column`."""
    prompt_format: str = "auto"
    """How a prompt becomes token ids: `auto` (chat messages through the tokenizer's chat template, plain text as
    written), `chat` (plain text too, as one user message after `system_prompt`), `raw` (plain text exactly as
    written; chat messages are an error)."""
    system_prompt: str | None = None
    """System message put first in every chat prompt that has none (e.g. the answer format your rewards check)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the tokenizer's chat template, e.g. `{enable_thinking: false}` for Qwen3."""
    max_prompt_length: int | None = None
    """Longest prompt in tokens; longer prompts are skipped and counted (`data/prompts_skipped_too_long`), never
    truncated. Unset: the server's `max_model_len` (read from /v1/models at start) minus `max_completion_length`;
    when both are known the smaller wins."""
    parse_responses: bool = True
    """Parse chat completions with transformers' `tokenizer.parse_response` (content, thinking, tool calls) and hand
    the parsed messages to reward functions as `parsed`. Uses the tokenizer's `response_template`, else the one
    transformers ships for the model type (Qwen2/2.5/3, Gemma 4); without either there is no `parsed`."""
    reward_funcs: list[str] | None = None
    """Required unless the toy world's prompts are chosen (then `asyncgrpo.toy:larger_reward`) or `environment_factory`
    names a class with `get_reward()`. Reward functions as `package.module:function`, TRL signature `fn(prompts,
    completions, **columns)` returning one float per completion, or None where the function does not apply. Built-ins:
    `asyncgrpo.rewards:math_accuracy`, `asyncgrpo.rewards:format_reward`, `asyncgrpo.rewards:length_penalty`. A factory
    (a function without a `completions` argument, such as TRL's `trl.rewards:get_soft_overlong_punishment` or the
    built-in `asyncgrpo.rewards:get_soft_overlong_punishment`) is called with its `reward_kwargs` and the function it
    returns is used. A function may be `async def`. An entry without `:` is a reward model: the directory (or hub id)
    of a sequence-classification checkpoint (`AutoModelForSequenceClassification`), scoring prompt + completion."""
    reward_weights: list[float] | None = None
    """Weight of each reward function; a completion's reward is the weighted sum over the functions that apply to
    it (did not return None). Default 1.0 each."""
    reward_kwargs: dict[str, dict[str, Any]] | None = None
    """Keyword arguments per reward function, keyed by its name or its `module:function`, e.g.
    `{format_reward: {pattern: "<answer>.*</answer>"}, length_penalty: {max_length: 512}}`."""
    reward_fallback: float | None = None
    """Reward used when a reward function raises, or when no function applies to a completion (counted in
    `reward/fallbacks_total`). Unset (default): either stops the run with the function's name and the sample."""
    reward_workers: int = 0
    """Processes that decode and score completions (rank 0 starts them with `spawn`). 0 (default): score in the
    rollout request threads inside the training process, sharing its GIL with the training loop. N: N worker
    processes, each loading the reward functions and the tokenizer itself; use them for CPU-heavy pure-Python
    rewards (each worker costs a Python process with the tokenizer and your reward modules loaded)."""
    reward_timeout: float = 60.0
    """Seconds one scoring call (decoding + every reward function, one group) may take. A call past it stops the run
    naming the function that was running and the prompt. In a reward worker (`reward_workers` > 0) the worker is
    killed and replaced; in-thread (`reward_workers: 0`) the call's thread cannot be stopped and is left running."""

    RANGES: ClassVar[dict[str, Range]] = {
        "max_prompt_length": Range(1, fix="leave it unset to derive it from the server's max_model_len"),
        "reward_weights": Range(fix="give each reward function a finite weight, e.g. 1.0"),
        "reward_fallback": Range(fix="use a finite reward such as 0.0, or unset it"),
        "reward_workers": Range(0, 1024, fix="use 0 to score in the request threads, or a few worker processes"),
        "reward_timeout": Range(0, low_open=True, fix="give the seconds one group's scoring may take, e.g. 60"),
    }

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"prompt_format": PROMPT_FORMATS}

    def check(self) -> None:
        if self.system_prompt is not None and self.prompt_format == "raw":
            raise ConfigError("system_prompt", "is set but prompt_format is raw (no chat template is applied)",
                              "set `prompt_format: chat` (or auto with chat messages), or remove system_prompt")
        if self.data_files is not None and self.dataset_name == "toy":
            raise ConfigError("dataset_name", "is `toy` but data_files is set",
                              "set dataset_name to the files' format: json (also .jsonl), parquet, csv or arrow")
        names = {reward_name(r) for r in self.reward_funcs or []} | set(self.reward_funcs or [])
        for key, value in (self.reward_kwargs or {}).items():
            if key not in names:
                raise ConfigError("reward_kwargs", f"{key!r} is not one of reward_funcs ({self.reward_funcs})",
                                  "key each entry by a reward function's name, e.g. `format_reward`")
            if not isinstance(value, dict):
                raise ConfigError("reward_kwargs", f"the entry for {key!r} is {value!r}, not a mapping",
                                  f"write `{key}: {{argument: value}}`")
        if self.reward_funcs is None:  # not given: task_problems() says so
            return
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError("reward_weights", f"has {len(self.reward_weights)} entries for "
                              f"{len(self.reward_funcs)} reward_funcs", "give one weight per reward function")
        for ref in self.reward_funcs:
            if not (_is_function_ref(ref) if ":" in ref else "/" in ref or Path(ref).exists()):
                raise ConfigError("reward_funcs", f"{ref!r} is neither package.module:function nor a reward model's "
                                  "directory or hub id", "write e.g. `asyncgrpo.toy:larger_reward`, or a checkpoint's "
                                  "path")


@dataclass
class AgentSettings(Section):
    """Multi-turn, tool-calling episodes (docs/agents.md). Read by rollout/episodes.py, tools.py and environments.py."""

    tools: list[str] = field(default_factory=list)
    """Tools the model may call, as `package.module:function` (sync or async, type hints and a Google docstring,
    as TRL). Their schemas (transformers' `get_json_schema`) go to the chat template; a completion becomes an
    episode: model turn, tool calls, tool results, next turn. Empty with no `environment_factory`: one completion
    per prompt, as always."""
    environment_factory: str | None = None
    """A class, or a function taking no argument that returns an instance, as `package.module:name` (TRL's
    contract). Each episode has an instance of its own while it runs; instances are reused (`reset(**row)` first:
    it gets the whole dataset row and may return text appended to the last user message) and `close()`d at the end.
    The instance's public methods other than reset/get_reward/close are tools; an optional `get_reward()` is an extra
    reward named after the class."""
    max_turns: int = 8
    """Most model turns in one episode; an episode that still calls a tool then ends there (not truncated)."""
    max_episode_tokens: int | None = None
    """Most tokens of an episode after its prompt (sampled, tool and template tokens). An episode that reaches it
    is truncated (`mask_truncated_completions` applies). Unset: only the server's `max_model_len` bounds it. Each
    model turn samples at most `max_completion_length` tokens."""
    tool_timeout: float = 30.0
    """Seconds one tool call may take; past it the call is stopped (the processes it started are killed, an exception
    is raised in its thread) and the model reads an error saying so."""
    max_tool_calls_per_turn: int = 8
    """Most tool calls run for one model turn; the model reads an error for each call past it (not run)."""
    tool_output_max_chars: int | None = 16384
    """Longest tool result in characters, cut before it is tokenized; the model reads a line saying how much was
    cut. Unset: no cap."""
    tool_output_max_tokens: int | None = 2048
    """Longest tool result in tokens (after the character cap), cut the same visible way. Unset: no cap (the
    episode's token budgets still hold)."""
    tool_process: bool = False
    """Run each call of a `tools` function in a fresh process of its own: started without the run's keys
    (`ASYNCGRPO_VLLM_API_KEY`, `ASYNCGRPO_ROLLOUT_KEY`) in a new user and PID namespace (`unshare`), so that it
    cannot read them from any other process either, and killed whole at `tool_timeout`. For tools that run code the
    model wrote. Costs a Python start per call; environment methods still run in the rollout process."""
    agent_function: str | None = None
    """Your own agent, as `package.module:function` (sync or async), written with any OpenAI client: called once per
    episode as `fn(row, base_url=..., model=..., api_key=...)` (the names it accepts), it talks to the rollout side's
    OpenAI-compatible endpoint at `base_url` with `model`, and returns the episode's reward (a float) or a dict the
    reward functions read as columns. Its calls become token-exact training samples. Excludes `tools` and
    `environment_factory` (the agent runs its own tools). docs/agents.md, "Your own agent"."""
    agent_endpoint_host: str = "127.0.0.1"
    """Where the agent endpoint listens. Any address other than a loopback one needs a key in ASYNCGRPO_AGENT_KEY
    (sent by the agent as its API key)."""
    agent_endpoint_port: int = 0
    """The agent endpoint's port; 0 = a free one, chosen at start."""
    episode_version: str = "pinned"
    """Which adapter an episode's later turns are sent to. `pinned` (default): every turn on the version its group
    was sent with, so each episode is sampled by one policy. `latest`: each turn on the newest served version (the
    adapters turns in flight use stay loaded); a group is as old as its oldest sampled token for `max_staleness`.
    Why pinned is the default and what latest measured: docs/agents.md, "Versions inside an episode"."""

    RANGES: ClassVar[dict[str, Range]] = {
        "agent_endpoint_port": Range(0, 65535, fix="use 0 (a free port) or a port number"),
        "max_turns": Range(1, fix="use the most model turns an episode may take, e.g. 8"),
        "max_episode_tokens": Range(1, fix="use the most tokens an episode may have after its prompt, or unset it"),
        "tool_timeout": Range(0, low_open=True, fix="give the seconds one tool call may take, e.g. 30"),
        "max_tool_calls_per_turn": Range(1, fix="use the most tool calls one turn may run, e.g. 8"),
        "tool_output_max_chars": Range(1, fix="use the longest tool result in characters, e.g. 16384, or unset it"),
        "tool_output_max_tokens": Range(1, fix="use the longest tool result in tokens, e.g. 2048, or unset it"),
    }

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"episode_version": EPISODE_VERSIONS}
    CHOICE_FIX: ClassVar[dict[str, str]] = {"episode_version": "use pinned or latest"}

    @property
    def uses_tools(self) -> bool:
        """Completions are episodes: tools or an environment are configured."""
        return bool(self.tools) or self.environment_factory is not None

    @property
    def uses_episodes(self) -> bool:
        """Completions are episodes: tools, an environment or an agent function."""
        return self.uses_tools or self.agent_function is not None

    def check(self) -> None:
        for key, refs in (("tools", self.tools), ("environment_factory", [self.environment_factory] * (
                self.environment_factory is not None))):
            for ref in refs:
                if not isinstance(ref, str) or ":" not in ref:
                    raise ConfigError(key, f"{ref!r} is not of the form package.module:name",
                                      "write e.g. `my_agent.tools:lookup` (a function) or `my_agent.env:MyEnv` (a class)")
        if self.agent_function is not None and not _is_function_ref(self.agent_function):
            raise ConfigError("agent_function", f"{self.agent_function!r} is not of the form package.module:function",
                              "write e.g. `my_agent.run:episode`")
        if self.agent_function is not None and (self.tools or self.environment_factory):
            raise ConfigError("agent_function", "is set beside `tools`/`environment_factory`, but an agent function "
                              "runs its own tools through the endpoint", "drop `tools` and `environment_factory`, "
                              "or drop `agent_function`")
        if self.agent_endpoint_host not in LOOPBACK_HOSTS and not os.environ.get(AGENT_KEY_ENV):
            raise ConfigError("agent_endpoint_host", f"is {self.agent_endpoint_host!r}, reachable from other hosts, "
                              f"but {AGENT_KEY_ENV} is not set: anyone there could sample from the policy",
                              f"set {AGENT_KEY_ENV} (the agent sends it as its API key), or listen on 127.0.0.1")
        if self.tool_process and not self.tools:
            raise ConfigError("tool_process", "is true, but no `tools` are named (an environment's methods run in the "
                              "rollout process, where their instance lives)", "name the tools to isolate under "
                              "`tools`, or set `tool_process: false`")


@dataclass
class GenerationSettings(Section):
    """Sampling on the inference servers. Read by the rollout producer and the HTTP client."""

    num_generations: int = 8
    """Completions sampled per prompt (the GRPO group size)."""
    max_completion_length: int = 256
    """Most tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature on the inference server; the trainer scales its logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling on the server. Only 1.0 is accepted: the loss scores the full distribution, and a nucleus
    would make every step off-policy. Every other sampling field (top_k, min_p, penalties) is sent at its neutral
    value."""
    max_inflight_requests: int | None = None
    """HTTP generation requests (one prompt group each) the rollout producer keeps in flight. Unset: sized from the
    batch, the staleness and the servers: a whole step's groups, two steps' worth when
    `max_staleness` >= 1 (the next batch starts while the last requests of this one finish), and at least 2 per
    server. The staleness bound still decides when each request may be sent. With `adaptive_inflight`, the most
    it may grow to."""
    adaptive_inflight: bool = False
    """Let the number of requests in flight follow what keeps the trainer fed and the servers busy: after each batch
    it grows by one per server when the trainer waited and the limit was reached, holds while a server has requests
    queued, and shrinks by a quarter when a server's KV cache is 90% used (read from vLLM's `/metrics`). It starts at
    the size `max_inflight_requests` unset gives and stays between the number of servers and `max_inflight_requests`
    (unset: the groups the staleness bound lets be pending). Logged as `queue/inflight_limit`."""
    seeded_generation: bool = False
    """Send every generation request a seed derived from `seed` and the prompt's position in the data stream, so
    that a run (and a run resumed from a checkpoint) samples the same completions. On vLLM CPU, seeded requests crash
    the engine when a prompt is chunk-prefilled: start the server with `--max-num-batched-tokens` >=
    max_inflight_requests x num_generations x (prompt + completion tokens)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "num_generations": Range(2, fix="use 2 or more for group-relative advantages (8 is typical)"),
        "max_completion_length": Range(1, fix="use the most tokens a completion may have, e.g. 256"),
        "temperature": Range(0, low_open=True, fix="sample with temperature 1.0 (the policy's own distribution)"),
        "top_p": Range(0, 1, low_open=True, fix="set `top_p: 1.0` (the default)"),
        "max_inflight_requests": Range(1, fix="use 1 or more, or unset it to size it from the batch"),
    }

    def check(self) -> None:
        if self.top_p != 1.0:
            # The server would sample from the nucleus and report logprobs renormalised over it, while the loss
            # scores the full softmax: every step would be off-policy (measured: max |log ratio| 0.66 at top_p 0.5).
            raise ConfigError("top_p", f"{self.top_p} is not supported: the trainer scores the full distribution, "
                              f"the server would sample from the top-p nucleus only", "set `top_p: 1.0` (the default)")


@dataclass
class TrainingSettings(Section):
    """The optimizer, its schedule and the run's length. Read by trainer/policy.py and trainer/schedule.py."""

    per_device_train_batch_size: int = 64
    """Completions per rank per micro-step. Global batch = this x ranks x gradient_accumulation_steps, and it
    must be a multiple of `num_generations` (whole groups)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step."""
    learning_rate: float = 1e-5
    """AdamW peak learning rate; `lr_scheduler_type` and the warm-up shape it over the run."""
    lr_scheduler_type: str = "linear"
    """Learning-rate schedule over `max_steps` optimizer steps (transformers' names): `constant`,
    `constant_with_warmup`, `linear` (default, TRL's and transformers': warm-up, then linear decay to 0) or `cosine`
    (warm-up, then half a cosine to 0). The schedule is a function of the step alone, stepped once per
    optimizer step on every backend, and saved in checkpoints."""
    warmup_ratio: float = 0.0
    """Fraction of `max_steps` over which the learning rate rises linearly from 0 (transformers' `warmup_ratio`)."""
    warmup_steps: float = 0
    """Warm-up length: optimizer steps when >= 1, a fraction of `max_steps` when below 1 (transformers 5's
    `warmup_steps`, which took over `warmup_ratio`); overrides `warmup_ratio` when > 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping."""
    max_steps: int = 100
    """Optimizer steps to run. A file that gives `num_train_epochs` and no max_steps (or transformers' unset value
    `max_steps: -1`) runs the epochs instead."""
    num_train_epochs: float | None = None
    """Passes over the training prompts: at start, rank 0 counts the training split's rows and the run takes
    ceil(num_train_epochs x rows x num_iterations / prompts per step) optimizer steps (a batch is trained on
    `num_iterations` times). A max_steps given beside it wins, as in transformers. Unset: `max_steps`."""
    num_iterations: int = 1
    """Optimizer steps taken on each generated batch (TRL's `num_iterations`, the GRPO paper's mu): a batch is taken
    from the rollout queue once, collated once (and its reference logprobs computed once when `beta` > 0), and
    trained on this many times, the clipped importance ratio against the server's behaviour logprobs keeping the
    later passes close. More iterations = less generation per optimizer step: the knob that balances generation
    against training. Set `weight_sync_steps` to it to publish once per batch, as TRL does: staleness counts
    published versions, so with `weight_sync_steps: 1` a batch's later passes lag the trainer by more versions and
    `max_staleness` 1 overlaps generation with only the last pass of a batch."""
    seed: int = 0
    """Seed for data order, initialisation and sampling on the trainer side."""

    RANGES: ClassVar[dict[str, Range]] = {
        "per_device_train_batch_size": Range(1, fix="use a multiple of num_generations"),
        "gradient_accumulation_steps": Range(1, fix="use 1 or more"),
        "learning_rate": Range(0, low_open=True, fix="use e.g. 1e-5 (LoRA: 1e-5 to 1e-3)"),
        "warmup_ratio": Range(0, 1, high_open=True, fix="use e.g. 0.05"),
        "warmup_steps": Range(0, fix="use 0, a number of steps such as 10, or a fraction of max_steps such as 0.05"),
        "weight_decay": Range(0, fix="use 0 or e.g. 0.01"),
        "adam_beta1": Range(0, 1, high_open=True, fix="use 0.9 (the default)"),
        "adam_beta2": Range(0, 1, high_open=True, fix="use 0.999 (the default)"),
        "max_grad_norm": Range(0, fix="use 1.0, or 0 to disable clipping"),
        "max_steps": Range(1, fix="use 1 or more"),
        "num_train_epochs": Range(0, low_open=True, fix="use e.g. 1, or unset it and set max_steps"),
        "num_iterations": Range(1, fix="use 1 (TRL's default) or a few"),
        "seed": Range(0, fix="use a seed >= 0, e.g. 0"),
    }

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"lr_scheduler_type": LR_SCHEDULERS}

    @property
    def num_warmup_steps(self) -> int:
        """Warm-up length in optimizer steps: `warmup_steps` (>= 1: steps, below 1: a fraction of max_steps), else
        `warmup_ratio` x max_steps; fractions are rounded up (as transformers does)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil((self.warmup_steps or self.warmup_ratio) * self.max_steps)

    def check(self) -> None:
        if self.lr_scheduler_type == "constant" and (self.warmup_steps or self.warmup_ratio):
            raise ConfigError("lr_scheduler_type", "is `constant`, which has no warm-up (transformers ignores "
                              "warmup_* there silently)", "use lr_scheduler_type: constant_with_warmup")


@dataclass
class LossSettings(Section):
    """The GRPO loss, its off-policy corrections and the advantages. Read by trainer/loss.py (`LossSpec`) and the scoring of groups."""

    epsilon: float = 0.2
    """Lower clip range of the importance ratio: ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = None
    """Upper clip range; unset = `epsilon` (DAPO: 0.28). With `loss_type: cispo` it is the cap on the ratio itself
    (TRL's and ScaleRL's epsilon_max; 5.0 recommended)."""
    delta: float | None = 3.0
    """Upper bound on the unclipped importance ratio (TRL's `delta`, INTELLECT-2's two-sided clip, verl's dual-clip
    `clip_ratio_c`). It matters for negative advantages, where the clipped surrogate is otherwise unbounded in the
    ratio (a token 12 nats more likely under the trainer than under the sampler weighs e^12 = 1.6e5 times its
    advantage); beyond `delta` such a token gets no gradient. Must be > 1 + epsilon_high. Default 3 (verl's value;
    TRL's default is unset): training is asynchronous by default, and this keeps every token's weight bounded.
    `null`: no bound (docs/losses.md, "Bounds", says what then happens past e^20)."""
    loss_type: str = "dapo"
    """Loss aggregation/objective (TRL's `loss_type`; docs/losses.md): `dapo` (default: token mean over the global
    batch), `grpo` (each sequence's token mean, then the mean over sequences: length-biased), `bnpo` (token mean
    per micro-batch), `dr_grpo` (token sum / (sequences x max_completion_length): no length bias), `cispo` (the
    capped, detached ratio weights the log-probability: no token loses its gradient; needs epsilon_high > 1),
    `sapo` (a soft sigmoid gate in place of the clip, aggregated as `grpo`), `luspo` (each sequence's token sum,
    then the mean over sequences; meant for `importance_sampling_level: sequence`)."""
    sapo_temperature_pos: float = 1.0
    """`loss_type: sapo`: the gate's temperature for tokens with a positive advantage (TRL's name and default)."""
    sapo_temperature_neg: float = 1.05
    """`loss_type: sapo`: the gate's temperature for tokens with a zero or negative advantage (TRL's default)."""
    importance_sampling_level: str = "token"
    """`token`: one importance ratio per token; `sequence`: the sequence's geometric-mean ratio for all its tokens
    (GSPO; TRL's `importance_sampling_level`). GSPO's paper pairs it with `loss_type: grpo` and tiny clip ranges
    (epsilon 3e-4, epsilon_high 4e-4)."""
    vllm_importance_sampling_correction: bool = False
    """Off-policy correction (TRL's name; TRL's default is true, ours false = today's behaviour). Off: the ratio is
    clipped against the server's behaviour logprobs. On: decoupled PPO: the ratio is clipped against the proximal
    policy, the trainer at the batch's first pass (TRL's "old" logprobs), and every token is weighted by the ratio
    proximal / behaviour, truncated or masked per `vllm_importance_sampling_mode`. The proximal logprobs are the
    first pass's own, detached and kept for the batch's `num_iterations` passes: no extra forward. With
    `num_iterations: 1` this is truncated/masked importance-sampling policy gradient, which drops the clip's trust
    region: on the toy it did not beat `false` up to `max_staleness: 8` (docs/losses.md, measured)."""
    vllm_importance_sampling_mode: str = "token_truncate"
    """How the weight proximal / behaviour is bounded (TRL's names): `token_truncate` (per token, capped at
    `vllm_importance_sampling_cap`), `token_mask` (per token, 0 above the cap), `sequence_truncate`,
    `sequence_mask` (the product over the sequence's tokens, capped or masked for the whole sequence)."""
    vllm_importance_sampling_cap: float = 3.0
    """The cap C of `vllm_importance_sampling_mode` (TRL's `vllm_importance_sampling_cap`); >= 1."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound of the importance weight (TRL's name): `*_truncate` modes raise weights below it to it, `*_mask`
    modes set them to 0. Unset (TRL's default): no lower bound. Must be below the cap."""
    off_policy_mask_threshold: float | None = None
    """TRL's off-policy sequence mask (DeepSeek-V3.2): a completion with a negative advantage whose mean per-token
    log(behaviour / trainer) exceeds this is left out of the loss. Unset (TRL's default): off; 0.5 is TRL's
    example."""
    use_bias_correction_kl: bool = False
    """Multiply the KL term by the (differentiable) importance ratio, which makes its gradient the unbiased
    reverse-KL gradient (DeepSeek-V3.2; TRL's name and default, false). Only matters with `beta` > 0."""
    top_entropy_quantile: float = 1.0
    """Train only on the highest-entropy tokens (TRL's name): the loss keeps the tokens whose entropy under the
    trainer is in the top `top_entropy_quantile` of each micro-batch's completion tokens (TRL pools all ranks'; 0.2
    is the paper's value). 1.0 (default): every token."""
    beta: float = 0.0
    """KL coefficient to the base model (the same model with the adapter disabled). 0 = no KL term."""
    scale_rewards: str | bool = "group"
    """How advantages are scaled (TRL's `scale_rewards`): `group` (or true: by each group's reward std, GRPO),
    `batch` (by the std of every reward in the training batch, PPO-Lite), `none` (or false: only subtract the
    group mean, Dr. GRPO)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose completions all got the same reward (zero std: no advantage, no
    gradient) is dropped when it reaches the queue, counted in `queue/dropped_zero_std_total`, and the producer
    generates another in its place, so every batch is full of groups that teach something. Costs generation when
    most groups are all right or all wrong. `train/frac_reward_zero_std` (TRL's metric) is logged either way."""
    mask_truncated_completions: bool = False
    """Leave completions that hit `max_completion_length` (finish_reason `length`) out of the loss (TRL's name; DAPO).
    They are still scored: reward functions get a `truncated` column either way, and
    `train/completions/clipped_ratio` is logged."""

    RANGES: ClassVar[dict[str, Range]] = {
        "epsilon": Range(0, low_open=True, fix="use epsilon: 0.2"),
        "epsilon_high": Range(0, low_open=True, fix="use 0.28 (DAPO), or unset it to use epsilon"),
        "delta": Range(1, low_open=True, fix="use delta: 3.0 (the default), or `delta: null` for no bound"),
        "sapo_temperature_pos": Range(0, low_open=True, fix="use 1.0 (TRL's default)"),
        "sapo_temperature_neg": Range(0, low_open=True, fix="use 1.05 (TRL's default)"),
        "vllm_importance_sampling_cap": Range(1, fix="use 2.0-5.0 (TRL's default is 3.0)"),
        "vllm_importance_sampling_clip_min": Range(0, fix="use e.g. 0.5, or unset it"),
        "off_policy_mask_threshold": Range(0, fix="use e.g. 0.5 (TRL's example), or unset it"),
        "top_entropy_quantile": Range(0, 1, low_open=True, fix="use e.g. 0.2 (the top fifth), or 1.0 for every token"),
        "beta": Range(0, fix="use 0 (no KL) or a small value like 0.04"),
    }

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "loss_type": LOSS_TYPES, "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
        "vllm_importance_sampling_mode": IS_MODES, "scale_rewards": SCALE_REWARDS}

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def check(self) -> None:
        if self.loss_type == "cispo" and self.epsilon_upper <= 1.0:
            raise ConfigError("epsilon_high", f"is {self.epsilon_upper}, but with loss_type cispo it caps the ratio "
                              f"itself (a cap <= 1 down-weights every token)", "set epsilon_high: 5.0 (ScaleRL, TRL)")
        clipped = self.loss_type not in ("cispo", "sapo")  # the loss types with PPO's clip, which delta extends
        if self.delta is not None and clipped and self.delta <= 1.0 + self.epsilon_upper:
            raise ConfigError("delta", f"{self.delta} is not above 1 + epsilon_high ({1.0 + self.epsilon_upper}); it "
                              f"would cut into the clip range", "use a delta above it, or `delta: null` (no bound)")
        clip_min = self.vllm_importance_sampling_clip_min
        if clip_min is not None and clip_min >= self.vllm_importance_sampling_cap:
            raise ConfigError("vllm_importance_sampling_clip_min", f"{clip_min} is not below the cap "
                              f"({self.vllm_importance_sampling_cap})", "use a value below the cap, e.g. 0.5, or "
                              "unset it")


@dataclass
class MemorySettings(Section):
    """Activation memory on the training ranks. Read by trainer/policy.py and trainer/batching.py."""

    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (transformers' gradient
    checkpointing, non-reentrant): much less activation memory for about one more forward's compute. On in the GPU
    recipes (TRL's name)."""
    max_tokens_per_microbatch: int = 0
    """Token budget of one micro-batch: this rank's completions are sorted by length and packed so that each
    micro-batch's padded size (sequences x longest prompt + completion) stays within it (a longer sequence gets a
    micro-batch of its own); every rank runs the same number of micro-batches. The loss is unchanged (still a mean
    over the global batch's tokens). 0 = off: `per_device_train_batch_size` completions (whole groups) per micro-batch."""

    RANGES: ClassVar[dict[str, Range]] = {
        "max_tokens_per_microbatch": Range(0, fix="use 0 (off) or a token budget such as 16384"),
    }



@dataclass
class AsyncSettings(Section):
    """Asynchrony and weight sync: staleness, publishing, where the rollout side runs. Read by rollout/admission.py, rollout/publish.py and transport/factory.py."""

    max_staleness: int = 1
    """Most policy versions a group may lag the trainer when its batch is taken from the queue. 0 = synchronous
    on-policy training: every batch is sampled by exactly the weights its training starts from, which needs
    `weight_sync_steps` to divide `num_iterations` (refused otherwise). With `num_iterations` > 1 a batch's later
    passes come after optimizer steps on it, off-policy by construction as in PPO (and they count the versions
    published since)."""
    weight_sync_steps: int = 1
    """Optimizer steps between adapter publications to the inference server."""
    publish_in_background: bool = True
    """Write and activate each adapter version on a background thread of rank 0, overlapping the next training
    step (the next sync waits for it, so versions go live in order). False: every sync waits for the server."""
    sync_mode: str = "pause"
    """How a new adapter version goes live: `pause` (pause -> load -> reset prefix cache -> resume) or `versioned`
    (load the new version beside the old one with no pause; requests in flight finish on the old version). Either
    way each version has its own adapter name, so the server needs `--max-loras` >= max_staleness + 2."""
    inflight_weight_updates: bool = False
    """Move completions still being sampled onto each new policy version (partial rollouts): when a version goes
    live, a completion in flight is stopped and continued from its tokens on the new adapter; every token keeps the
    version and behaviour logprob it was sampled with, and a group is as old as its oldest token for `max_staleness`.
    False (default): a completion finishes on the version it started on. With episodes (tools,
    `environment_factory`) each turn moves the same way, and needs `episode_version: latest` (every turn then starts
    on the newest version). What vLLM does to requests in flight and what this costs: docs/rollout-internals.md,
    "Weights updated in flight"."""
    rollout_mode: str = "batch"
    """When the rollout side may send a group. `batch` (default): a group is sent for a given batch, once the server
    serves a version close enough to the one that batch will be trained at (the most it can send without generating
    a group that must be dropped as too old). `stream`: a group is sent whenever the groups in flight plus those
    queued are fewer than `rollout_capacity`, and only when at least the trainer's next batch could still take it;
    the trainer takes the oldest complete groups within `max_staleness`. TRL has no equivalent. Each mode's staleness
    guarantee: docs/rollout-internals.md, "When a request may be sent"; batch measured faster than stream on both
    benchmark workloads, where stream dropped 33-50% of what it generated as too old: docs/benchmarks.md."""
    rollout_capacity: int | None = None
    """With `rollout_mode: stream`: groups in flight plus queued, at most. Unset: (`max_staleness` + 1) x the groups
    of one step, the most that can all be trained within the bound when sent at the trainer's version. Requests in
    flight are further capped by `max_inflight_requests` (sized from the servers)."""
    sync_pause_mode: str = "keep"
    """How `/pause` treats requests in flight during a sync: `keep` (freeze, continue after resume),
    `wait` (drain first), `abort` (end them; their generations are lost and counted, their prompts sent again)."""
    rollout_process: bool = False
    """Run rank 0's rollout side (producer, request threads, reward functions, publisher) in a child process rank 0
    spawns, talking to the trainer over a pipe: it no longer shares the training process's GIL and cores, and a
    reward function that crashes its interpreter stops the run with an error naming the rollout process instead of
    killing the trainer. False: the rollout side runs on threads of rank 0 (docs/running.md)."""
    rollout_address: str | None = None
    """`host:port` of a rollout side already running on its own (`asyncgrpo rollout-serve --listen HOST:PORT`, e.g.
    on another host): rank 0 connects to it over TCP instead of running or spawning one, with `rollout_process`'s
    interface and failure reports. Both ends take the connection key from the environment variable
    `ASYNCGRPO_ROLLOUT_KEY` (required, made by `asyncgrpo keygen`), over TLS. That side uses
    this config, which rank 0 sends it, except the paths it resolves itself (docs/running.md). None: the rollout side
    is rank 0's."""
    served_check_every: int = 1
    """Check every this many published versions that each server serves what was trained: the trainer's logprobs of
    a short probe from its first batch (prompt end + sampled completion) are compared with each server's under the
    new adapter name before the version is used; a difference above `served_check_tolerance` stops the run with an
    error naming the server, the version and the likely cause (the base served, an older adapter, a wrong rank,
    alpha or targets). One forward of <= 96 tokens on every rank per check. 0: off (docs/publish-internals.md)."""
    served_check_tolerance: float | None = None
    """The largest served - trained logprob difference on the probe a correct version may show. None: by the dtype
    the base was built in (`torch_dtype`, or bf16 when a DeepSpeed json turns bf16 on), from measurement (1e-3 for
    float32, 0.1 for bfloat16/float16); raise it if the server runs a lower precision than the trainer."""
    keep_adapter_versions: int = 3
    """Adapter version directories kept on disk per run; older ones are deleted once no server has them loaded."""
    keep_final_adapter: bool = True
    """At the end of a finished run, leave its final adapter version loaded on the servers (named in run_summary.json
    as `adapter_left_loaded`); every other version it loaded is unloaded. A failed run unloads all of them."""

    RANGES: ClassVar[dict[str, Range]] = {
        "max_staleness": Range(0, fix="use 0 for synchronous training or 1-4 for asynchronous"),
        "rollout_capacity": Range(1, fix="use at least the groups of one step, or unset it to size it from the staleness"),
        "weight_sync_steps": Range(1, fix="use 1 or num_iterations"),
        "keep_adapter_versions": Range(1, fix="use 3 (the default)"),
        "served_check_every": Range(0, fix="use 1 (every version, the default), N (every N-th) or 0 (off)"),
        "served_check_tolerance": Range(0, low_open=True, fix="unset it (by torch_dtype), or e.g. 0.2 for a bf16 server "
                                        "behind an fp32 trainer"),
    }

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"sync_mode": SYNC_MODES, "rollout_mode": ROLLOUT_MODES,
                                                     "sync_pause_mode": SYNC_PAUSE_MODES}
    CHOICE_FIX: ClassVar[dict[str, str]] = {"sync_mode": "use pause or versioned", "rollout_mode": "use batch or stream"}

    def stream_capacity(self, groups_per_step: int) -> int:
        """With `rollout_mode: stream`: groups in flight plus queued, at most (`rollout_capacity`, or one step's
        groups for every version of staleness allowed and the current one)."""
        if self.rollout_capacity is not None:
            return self.rollout_capacity
        return (self.max_staleness + 1) * groups_per_step

    def check(self) -> None:
        if self.rollout_address is None:
            return
        try:
            split_address(self.rollout_address)
        except ValueError as exc:
            raise ConfigError("rollout_address", f"{self.rollout_address!r} {exc}",
                              "write HOST:PORT as `asyncgrpo rollout-serve` logged it, e.g. "
                              "`rollout_address: 10.0.0.7:7480`") from None
        if self.rollout_process:
            raise ConfigError("rollout_address", f"{self.rollout_address!r} is set together with `rollout_process: "
                              f"true` (one connects to a rollout side running elsewhere, the other spawns one on rank "
                              f"0's host)", "drop `rollout_process: true` to connect to the rollout server, or drop "
                              "rollout_address to spawn the rollout side")


@dataclass
class InferenceSettings(Section):
    """The inference servers and how adapters reach them. Read by inference/ and rollout/delivery.py."""

    vllm_server_base_url: str | list[str] = "http://127.0.0.1:8000"
    """Base URL of the vLLM inference node (OpenAI-compatible server started with --enable-lora), or a list of them
    (YAML list, or comma-separated on the command line): rollout requests are spread over the servers and every
    sync reaches all of them."""
    adapter_delivery: str = "shared_fs"
    """How each adapter version reaches the inference servers: `shared_fs` (they read `lora_adapter_path` at the same
    path: shared storage) or `http` (no shared filesystem: the trainer uploads the files to an adapter receiver
    running beside each vLLM, `launch/vllm/receiver.sh`, which checks them and loads its own copy; see
    docs/delivery.md). Needs `adapter_receiver_url` with `http`."""
    adapter_receiver_url: str | list[str] | None = None
    """With `adapter_delivery: http`: the URL of the adapter receiver beside each server, in the order of
    `vllm_server_base_url` (one entry each; YAML list or comma-separated), e.g. `http://10.0.0.5:8001`."""
    vllm_server_timeout: float = 240.0
    """Seconds to wait for an inference server to become healthy: at start, and after it stops answering mid-run
    (killed, crashed, restarting). Meanwhile rollouts go to the other servers and syncs wait; once it is back it gets
    the current adapter re-registered before any generation. A server not back in time ends the run with an error."""
    vllm_request_timeout: float = 120.0
    """Seconds one HTTP request to the server may take before it is an error."""

    RANGES: ClassVar[dict[str, Range]] = {
        "vllm_server_timeout": Range(0, low_open=True, fix=f"use {_SECONDS}, e.g. 240"),
        "vllm_request_timeout": Range(0, low_open=True, fix=f"use {_SECONDS}, e.g. 120"),
    }

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"adapter_delivery": ADAPTER_DELIVERIES}
    CHOICE_FIX: ClassVar[dict[str, str]] = {"adapter_delivery": "use shared_fs or http"}

    @property
    def server_urls(self) -> list[str]:
        """`vllm_server_base_url` as a list (one entry per inference server)."""
        urls = self.vllm_server_base_url
        return [urls] if isinstance(urls, str) else list(urls)

    @property
    def receiver_urls(self) -> list[str]:
        """`adapter_receiver_url` as a list (one entry per inference server; empty when unset)."""
        urls = self.adapter_receiver_url
        return [] if urls is None else [urls] if isinstance(urls, str) else list(urls)

    @property
    def api_key(self) -> str | None:
        """The server API key, read from the environment only, so it never lands in a saved config."""
        return os.environ.get(API_KEY_ENV) or None

    def value_problems(self) -> list[ConfigError]:
        problems = []
        for key in URL_KEYS:
            urls = getattr(self, key)
            for url in [urls] if isinstance(urls, str) else urls or []:
                problem = _url_problem(url)
                if problem:
                    problems.append(ConfigError(key, problem[0], problem[1]))
                    break
        return problems

    def check(self) -> None:
        receivers = self.receiver_urls
        if self.adapter_delivery == "shared_fs":
            if receivers:
                raise ConfigError("adapter_receiver_url", "is set, but adapter_delivery is shared_fs (the servers "
                                  "read lora_adapter_path themselves)", "set adapter_delivery: http, or remove it")
            return
        if len(receivers) != len(self.server_urls):
            raise ConfigError("adapter_receiver_url", f"has {len(receivers)} entries for {len(self.server_urls)} "
                              f"vllm_server_base_url", "give the receiver beside each server, in the same order, "
                              "e.g. adapter_receiver_url: http://10.0.0.5:8001 (launch/vllm/receiver.sh)")


@dataclass
class OutputSettings(Section):
    """Where the run writes and what it logs. Read by the trackers and the recipe's logging."""

    output_dir: str = "runs/asyncgrpo"
    """Where the run writes: the final adapter in PEFT format (`adapter_model.safetensors` and `adapter_config.json`
    in output_dir itself, as TRL's `save_model` writes them, with a model card `README.md`), `checkpoint-<step>/`,
    `tensorboard/`, `config.yaml` and `run_summary.json`."""
    logging_steps: int = 1
    """Optimizer steps between metric writes (every tracker in `report_to`)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers the metrics go to, through accelerate's trackers: any of `tensorboard`
    (`<output_dir>/tensorboard`), `wandb` (`<output_dir>/wandb`; `WANDB_MODE=offline` without a network),
    `trackio` (local, `$TRACKIO_DIR`), `mlflow`, `comet_ml`, `aim`, `clearml`, `dvclive`, `swanlab`; `all` (every
    installed one) or `none`. A tracker whose package is missing stops the run at start naming the pip install."""
    run_name: str | None = None
    """The run's name in the trackers (wandb, trackio, mlflow). Unset: `<output_dir's name>-<run id>`."""
    log_completions: bool = False
    """Every logging step, log a table of the step's completions (prompt, completion, each reward function's
    value, total reward, advantage) to every tracker and append it to `<output_dir>/completions.jsonl`."""
    num_completions_to_print: int | None = None
    """Rows per completions table (the first completions of the step's batch). Unset: every completion of the batch,
    up to 64."""

    RANGES: ClassVar[dict[str, Range]] = {
        "logging_steps": Range(1, fix="use 1 or more"),
        "num_completions_to_print": Range(1, fix="use 1 or more, or unset it to log every completion (up to 64)"),
    }

    def check(self) -> None:
        resolve_report_to(self.report_to, check_installed=False)  # installed: checked where trackers open


@dataclass
class EvalSettings(Section):
    """Held-out evaluation. Read by trainer/evaluator.py and rollout/evaluation.py."""

    eval_strategy: str = "no"
    """`steps`: every `eval_steps`, and at the last step, measure the held-out reward of `eval_dataset` (unset: the
    `dataset_test_split` split of `dataset_name`) through the server under the adapter just published (logged as
    `eval/reward`); `no`: never."""
    eval_steps: int | None = None
    """Optimizer steps between evaluations with `eval_strategy: steps` (a multiple of `weight_sync_steps`). Unset:
    `logging_steps`."""
    eval_dataset: str | None = None
    """Held-out prompts for `eval_strategy: steps`: `toy` (the toy world's held-out split), or a local data file or
    `save_to_disk` directory in the training data's format (same prompt column and reward columns). Unset: the
    `dataset_test_split` split of `dataset_name`."""
    num_generations_eval: int | None = None
    """Completions sampled per held-out prompt at evaluation (at `temperature`). Unset: `num_generations`."""

    RANGES: ClassVar[dict[str, Range]] = {
        "eval_steps": Range(1, fix="use 1 or more, or unset it to evaluate every logging_steps"),
        "num_generations_eval": Range(1, fix="use 1 or more, or unset it to use num_generations"),
    }

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"eval_strategy": EVAL_STRATEGIES}
    CHOICE_FIX: ClassVar[dict[str, str]] = {"eval_strategy": "use steps or no"}

    def interval(self, logging_steps: int) -> int:
        """Optimizer steps between evaluations: `eval_steps`, else the run's `logging_steps` (OutputSettings')."""
        return self.eval_steps or logging_steps

    def check(self) -> None:
        if self.eval_strategy == "no" and self.eval_dataset:  # eval_steps alone is accepted, as TRL does
            raise ConfigError("eval_strategy", "is `no`, but eval_dataset is set (no evaluation would run)",
                              "set `eval_strategy: steps`, or drop eval_dataset")


@dataclass
class CheckpointSettings(Section):
    """Checkpoints and resuming. Read by trainer/checkpoint.py."""

    save_steps: int = 0
    """Save a checkpoint to `<output_dir>/checkpoint-<step>/` every this many optimizer steps (the adapter's PEFT files
    at its top, as TRL's, with a model card and TRL's trainer_state.json; optimizer, RNG states, data position, policy
    version, step; written atomically), and at the last step. 0 = never.
    Must be a multiple of `weight_sync_steps` and of `num_iterations`. DDP (also torchrun, one process), FSDP1, FSDP2,
    ZeRO-2 and ZeRO-3."""
    save_total_limit: int | None = None
    """Keep only the newest this many checkpoints (older ones are deleted after each save). Unset = keep all."""
    stop_grace_s: float = 20.0
    """With `save_steps` set: on SIGTERM (`scancel`, a preemption, `docker stop`), seconds to go on to the next step
    that can be resumed from exactly, save a checkpoint there and exit 143; past it the run exits 143 without one. 0
    = exit at once. Keep it below the time your scheduler waits before SIGKILL (SLURM `KillWait`, `docker stop -t`),
    less ~10 s to stop the servers (docs/faults.md#nothing-left-running)."""
    resume_from_checkpoint: str | None = None
    """Continue a run: `latest` (or `true`, as in transformers: the newest `checkpoint-<step>` in `output_dir`; an
    error when there is none) or a checkpoint directory. Step numbers and policy versions continue; the adapter is
    re-published to every server
    before generation starts."""

    RANGES: ClassVar[dict[str, Range]] = {
        "save_steps": Range(0, fix="use 0 (never) or e.g. 100"),
        "save_total_limit": Range(1, fix="unset it to keep every checkpoint"),
        "stop_grace_s": Range(0, fix="use 0 (exit at once on SIGTERM) or e.g. 20, below the scheduler's SIGKILL delay"),
    }

    def check(self) -> None:
        if self.resume_from_checkpoint == "":
            raise ConfigError("resume_from_checkpoint", "is empty", "use `latest` or a checkpoint-<step> directory")


@dataclass
class LaunchSettings(Section):
    """How the training processes are launched and wait for each other. Read by the recipe's setup."""

    deepspeed: str | None = None
    """A DeepSpeed JSON config (e.g. `launch/deepspeed/zero3.json`) for runs started by the `deepspeed` launcher
    (or `torchrun`), which, unlike `accelerate launch --config_file ...`, tell the trainer nothing about DeepSpeed.
    Ignored, with a warning, when `accelerate launch` already configured DeepSpeed. A json whose `bf16.enabled` is
    on (`true`, or `auto` under bf16 mixed precision) is translated: the base model is held in bf16, while the LoRA
    weights and their optimizer state stay fp32 (DeepSpeed's own bf16 mode is switched off)."""
    ddp_timeout: int = 3600
    """Seconds a collective may wait for the other ranks before the run fails (default 60 minutes; lower in tests);
    the default covers every wait below with the default timeouts, `adapter_delivery: http` included. With several
    ranks it must exceed rank 0's longest wait (checked at start; the error gives each term in seconds): a batch
    (4 x vllm_request_timeout + vllm_server_timeout), a sync through a server outage (vllm_server_timeout +
    vllm_request_timeout + the client's connection retries, plus twice the longest adapter upload to the receivers
    with `adapter_delivery: http`), or a held-out evaluation (ceil(eval prompts / 16) - 1 turns of
    vllm_request_timeout, plus one such outage)."""
    torch_num_threads: int = 0
    """Intra-op threads per training process; 0 = leave torch's default."""

    RANGES: ClassVar[dict[str, Range]] = {
        "ddp_timeout": Range(1, fix=f"use {_SECONDS}, e.g. 1800"),
        "torch_num_threads": Range(0, fix="use 0 (torch's default) or the cores per training process"),
    }

    def check(self) -> None:
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            raise ConfigError("deepspeed", f"file {self.deepspeed!r} does not exist",
                              "pass a DeepSpeed JSON such as launch/deepspeed/zero3.json (relative to where you launch)")


SECTIONS = (ModelSettings, DataSettings, AgentSettings, GenerationSettings, TrainingSettings, LossSettings,
            MemorySettings, AsyncSettings, InferenceSettings, OutputSettings, EvalSettings, CheckpointSettings,
            LaunchSettings)


@dataclass
class AsyncGRPOConfig(LaunchSettings, CheckpointSettings, EvalSettings, OutputSettings, InferenceSettings, AsyncSettings,
                      MemorySettings, LossSettings, TrainingSettings, GenerationSettings, AgentSettings, DataSettings,
                      ModelSettings):  # the reverse of SECTIONS: a dataclass lists its last base's fields first
    """Every knob of a run: the sections' keys side by side, flat, under TRL's names (YAML, CLI, `from_dict`). Code
    that needs one concern takes its section (`cfg.section(LossSettings)`); the wiring (recipe, build, CLI) holds
    the whole. Each field's docstring is its reference documentation (rendered in docs/configuration.md)."""

    def __post_init__(self) -> None:
        # The toy world only when chosen: `model_name_or_path: toy` brings its prompts, `dataset_name: toy` its reward.
        if self.model_name_or_path == "toy" and self.dataset_name is None:
            self.dataset_name = "toy"
        if (self.environment_factory is not None or self.agent_function is not None) and self.reward_funcs is None:
            self.reward_funcs = []  # get_reward() (TRL) or the agent's own reward: no default beside it
        if self.dataset_name == "toy" and self.reward_funcs is None:
            self.reward_funcs = [TOY_REWARD]
        if isinstance(self.scale_rewards, bool):  # TRL's booleans
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.lora_adapter_path is None:
            self.lora_adapter_path = str(Path(self.output_dir) / "adapters")
        self.validate()

    def section(self, kind: type[SectionT]) -> SectionT:
        """A copy of one section's keys (`cfg.section(LossSettings)`): what a component that reads only that
        concern is handed, so that it cannot come to depend on the rest."""
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    # ---- what needs keys of several sections ----------------------------------------------------------------------
    def groups_per_step(self, world_size: int) -> int:
        """Prompt groups in one optimizer step's global batch over `world_size` ranks."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * world_size // self.num_generations

    def steps_for_epochs(self, rows: int, world_size: int) -> int:
        """Optimizer steps of `num_train_epochs` passes over `rows` prompts: each generated batch takes
        `groups_per_step` prompts and is trained on `num_iterations` times (at least 1 step)."""
        passes = self.num_train_epochs * rows * self.num_iterations / self.groups_per_step(world_size)
        return max(1, math.ceil(passes))

    def inflight_requests(self, groups_per_step: int) -> int:
        """Generation requests the producer keeps in flight: `max_inflight_requests`, or when unset a whole step's
        groups (two steps' worth when generation may run ahead), at least 2 per server. With `adaptive_inflight`,
        where the limit starts: that size, at most the ceiling."""
        steps_ahead = min(self.max_staleness + 1, 2)
        sized = max(groups_per_step * steps_ahead, 2 * len(self.server_urls))
        if self.adaptive_inflight:  # where the limit starts
            return min(sized, self.inflight_ceiling(groups_per_step))
        return self.max_inflight_requests if self.max_inflight_requests is not None else sized

    def inflight_ceiling(self, groups_per_step: int) -> int:
        """With `adaptive_inflight`: the most requests in flight the limit may grow to (`max_inflight_requests`, or
        the groups that may be pending: the stream capacity, or a batch for every version of staleness and the
        current one)."""
        if self.max_inflight_requests is not None:
            return self.max_inflight_requests
        pending = self.stream_capacity(groups_per_step) if self.rollout_mode == "stream" else \
            (self.max_staleness + 1) * groups_per_step
        return max(pending, 2 * len(self.server_urls))

    @property
    def evaluation_interval(self) -> int:
        """Optimizer steps between evaluations (`eval_steps`, else `logging_steps`)."""
        return self.interval(self.logging_steps)

    def task_problems(self) -> list[ConfigError]:
        """The keys every run must be given that are missing (model, prompts, reward), one error each. Not part of
        `validate`: a config may be built in code before its model and data are known; the trainer checks it."""
        return task_problems(self.model_name_or_path, self.dataset_name, self.reward_funcs,
                             self.environment_factory or self.agent_function) + self._eval_problems()

    def _eval_problems(self) -> list[ConfigError]:
        """Held-out prompts are a task key too: a script may pass `eval_dataset` to the trainer (api.py); without it
        they come from `dataset_test_split`, which an environment (no dataset) does not have."""
        if self.eval_strategy == "steps" and not self.eval_dataset and self.dataset_name == "environment":
            return [ConfigError("eval_dataset", "is required with eval_strategy: steps and `dataset_name: environment` "
                                "(no dataset to take dataset_test_split from)",
                                "name held-out prompts (a local data file), or set `eval_strategy: no`")]
        return []

    # ---- checks ---------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Every value alone (each section's RANGES and CHOICES), then each section's own checks and the checks
        across sections; every problem found is reported at once (one line each), each naming the key to change."""
        problems = value_problems(self)
        if not problems:
            checks = [AsyncGRPOConfig._check_batch, *(section.check_all for section in SECTIONS),
                      AsyncGRPOConfig._check_rewards, AsyncGRPOConfig._check_staleness, AsyncGRPOConfig._check_agents,
                      AsyncGRPOConfig._check_agent_function,
                      AsyncGRPOConfig._check_steps]
            for check in checks:
                try:
                    check(self)
                except ConfigError as exc:
                    problems.append(exc)
        raise_all(problems)

    def _check_batch(self) -> None:
        if self.per_device_train_batch_size % self.num_generations:
            raise ConfigError("per_device_train_batch_size",
                              f"{self.per_device_train_batch_size} is not a multiple of num_generations "
                              f"({self.num_generations}); groups cannot be split across ranks",
                              f"use a multiple of {self.num_generations}, e.g. "
                              f"{self.num_generations * max(1, self.per_device_train_batch_size // self.num_generations)}")

    def _check_rewards(self) -> None:
        if self.reward_funcs == [] and not (self.environment_factory or self.agent_function):  # checked at build
            raise ConfigError("reward_funcs", "is empty", "name at least one `module:function` or reward model")

    def _check_staleness(self) -> None:
        if self.max_staleness == 0 and self.num_iterations % self.weight_sync_steps:
            raise ConfigError("max_staleness", f"0 promises that every batch is sampled by the weights its training "
                              f"starts from, but with num_iterations {self.num_iterations} and weight_sync_steps "
                              f"{self.weight_sync_steps} some batches start training optimizer steps after the "
                              f"version that sampled them was published",
                              f"make weight_sync_steps divide num_iterations (e.g. weight_sync_steps: "
                              f"{self.num_iterations}), or allow staleness with max_staleness: 1")

    def _check_agents(self) -> None:
        if self.uses_tools and self.inflight_weight_updates and self.episode_version != "latest":
            raise ConfigError("inflight_weight_updates", "moves an episode's turn onto each new version while it is "
                              "sampled, but `episode_version: pinned` would send its next turn back to the version "
                              "the group started on", "set `episode_version: latest` as well")
        if self.uses_tools and self.reward_workers:
            raise ConfigError("reward_workers", f"is {self.reward_workers}, but episodes (tools/environment_factory) "
                              "are scored in the rollout process, where their environments live",
                              "set `reward_workers: 0`")
        if self.dataset_name == "environment" and not self.environment_factory:
            raise ConfigError("dataset_name", "is `environment` (reset() gives the prompts), but no "
                              "environment_factory is set", "set environment_factory, or name a dataset")
        if self.dataset_name == "environment" and self.num_train_epochs is not None:
            raise ConfigError("num_train_epochs", "is set, but with `dataset_name: environment` there are no rows to "
                              "pass over", "set max_steps instead")
        if self.uses_tools and self.prompt_format == "raw":
            raise ConfigError("prompt_format", "is raw, but tool calls need the chat template (tool schemas, tool "
                              "messages)", "use `prompt_format: auto` with chat messages, or `prompt_format: chat`")

    def _check_agent_function(self) -> None:
        if self.agent_function is None:
            return
        for key, value in (("reward_workers", self.reward_workers),
                           ("inflight_weight_updates", self.inflight_weight_updates)):
            if value:
                raise ConfigError(key, f"is {value}, but an agent function's episodes are sampled call by call and "
                                  "scored in the rollout process", f"set `{key}` to 0/false")

    def _check_steps(self) -> None:
        """Evaluations and checkpoints fall on steps where a version was just published, between two batches."""
        if self.eval_strategy == "steps" and self.evaluation_interval % self.weight_sync_steps:
            raise ConfigError("eval_steps", f"{self.evaluation_interval} is not a multiple of weight_sync_steps "
                              f"({self.weight_sync_steps}): evaluation measures the adapter just published",
                              f"use a multiple of {self.weight_sync_steps}")
        if self.save_steps and self.save_steps % self.weight_sync_steps:
            raise ConfigError("save_steps", f"{self.save_steps} is not a multiple of weight_sync_steps "
                              f"({self.weight_sync_steps}); a checkpoint must hold a published policy version",
                              f"use a multiple of {self.weight_sync_steps}")
        if self.save_steps and self.save_steps % self.num_iterations:
            raise ConfigError("save_steps", f"{self.save_steps} is not a multiple of num_iterations "
                              f"({self.num_iterations}); a checkpoint must fall between two generated batches",
                              f"use a multiple of {self.num_iterations}")

    # ---- loading --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict, *, require_task: bool = True) -> "AsyncGRPOConfig":
        """Build from a plain mapping (a parsed YAML file) in this project's or TRL's key names (trl_compat.py).
        Unknown keys, wrong types, TRL values that cannot be honoured and bad values are all reported at once.
        `require_task=False`: model, prompts and reward may be missing (a script passes them to the trainer)."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        values, problems = trl_compat.translate(values)
        if require_task:
            problems[:0] = task_problems(*(values.get(key) for key in ("model_name_or_path", "dataset_name",
                                                                       "reward_funcs")),
                                         values.get("environment_factory") or values.get("agent_function"))
        kwargs = {}
        for key, value in values.items():
            try:
                if key not in known:
                    raise trl_compat.unknown_key(key, known)
                kwargs[key] = _coerce(key, value, hints[key])
            except ConfigError as exc:
                problems.append(exc)
        try:
            config = cls(**kwargs)  # the keys that were right: their values and combinations are checked too
            if require_task:
                problems.extend(config._eval_problems())
        except ConfigErrors as exc:
            problems.extend(exc.errors)
        except ConfigError as exc:
            problems.append(exc)
        raise_all(problems)
        return config

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "AsyncGRPOConfig":
        """Read a YAML file (optional) and apply `--key value` / `--key=value` overrides on top."""
        return cls.from_dict(read_values(path, overrides))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML (the API key is never part of it)."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))




def read_values(path: str | Path | None = None, overrides: list[str] | None = None) -> dict:
    """The raw mapping of a YAML file (optional) with the command-line overrides on top, in the names written
    (this project's or TRL's): what `AsyncGRPOConfig.from_dict` and `trl_notice` read."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", f"file {str(path)!r} does not exist", "pass an existing YAML file")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError("--config", f"{str(path)!r} is not valid YAML ({_yaml_problem(exc)})",
                              "correct that line: one `key: value` per line, nested values indented under their key"
                              ) from None
        if not isinstance(loaded, dict):
            raise ConfigError("--config", f"{str(path)!r} is not a mapping of key: value",
                              "write one `key: value` per line")
        values.update(loaded)
    values.update(parse_overrides(overrides or []))
    return values


def defaults() -> dict[str, object]:
    """Every key's default."""
    return {name: default for name, _, default, _ in reference()}


def trl_notice(values: dict) -> str | None:
    """For a mapping written for TRL (`read_values`): the defaults it leaves out that differ from TRL's, with why
    (trl_compat.TRL_DEFAULTS), to print once at start; None for a config of ours."""
    return trl_compat.default_notice(values, defaults())


# Every int and float key has a range (a test checks that none is missing); an unset optional key (None) is not checked.
VALUE_RANGES: dict[str, Range] = {key: r for section in SECTIONS for key, r in section.RANGES.items()}
# Adapter names are served as `<lora_name>-<run id>-v<N>` and become directory names on the adapter receiver
# (inference_node/receiver.py accepts [A-Za-z0-9][A-Za-z0-9._-]{0,127}): no path separators, spaces, a leading `.` or
# `-` (a hidden file, a command-line flag), and room left for the run id and the version.
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
URL_KEYS = ("vllm_server_base_url", "adapter_receiver_url")
# The secrets asyncgrpo reads from the environment; reward workers start without them (rollout/reward_pool.py).
SECRET_ENV_VARS = (API_KEY_ENV, ROLLOUT_KEY_ENV, AGENT_KEY_ENV, "VLLM_API_KEY")


def task_problems(model, dataset, rewards, environment) -> list[ConfigError]:
    """One error per missing key of the three every run needs (values as given; None = not given). The toy world
    fills them only when chosen: `model_name_or_path: toy` (its prompts and reward), `dataset_name: toy` (its
    reward); an `environment_factory` (its get_reward()) or an `agent_function` (its float) may bring the reward."""
    problems = []
    if model is None:
        problems.append(ConfigError("model_name_or_path", "is required: asyncgrpo has no default model",
                                    "give the base model's directory or hub id (the one the vLLM server serves), e.g. "
                                    "`model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct`, or `model_name_or_path: toy` "
                                    "for the built-in toy world"))
    if dataset is None and model == "toy":
        dataset = "toy"
    if dataset is None:
        problems.append(ConfigError("dataset_name", "is required: asyncgrpo has no default prompts",
                                    "give a data file, a saved dataset directory or a hub dataset, e.g. "
                                    "`dataset_name: openai/gsm8k`, or `dataset_name: toy` for the toy world's prompts"))
    if rewards is None and environment is None and dataset != "toy":
        problems.append(ConfigError("reward_funcs", "is required: asyncgrpo has no default reward for your data",
                                    "name your reward functions, e.g. `reward_funcs: [asyncgrpo.rewards:math_accuracy]`"
                                    ", or give an environment_factory whose class has get_reward(), or an "
                                    "agent_function that returns the reward"))
    return problems


def raise_all(problems: list[ConfigError]) -> None:
    """Raise the one problem as it is, several as one ConfigErrors (one line each); nothing when there is none."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


def value_problems(cfg: AsyncGRPOConfig) -> list[ConfigError]:
    """Every key whose value alone is wrong (out of its section's range, not finite, not one of its choices), one
    error each."""
    problems = []
    for key, allowed in VALUE_RANGES.items():
        value = getattr(cfg, key)
        for item in value if isinstance(value, list) else [value]:
            if item is None:
                continue
            if isinstance(item, float) and not math.isfinite(item):
                problems.append(ConfigError(key, f"is {item}, not a finite number", allowed.fix))
                break
            if not allowed.holds(item):
                problems.append(ConfigError(key, f"is {item}, but must be {allowed.describe()}", allowed.fix))
                break
    for section in SECTIONS:
        problems += section.value_problems(cfg)
    return problems


def _url_problem(url: str) -> tuple[str, str] | None:
    """(problem, fix) for a server URL that is not a plain http(s) URL, or None. The value is quoted with any
    password masked: error messages end up in logs."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})", "write e.g. http://10.0.0.5:8000"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL", "write e.g. http://10.0.0.5:8000"
    if parts.username is not None or parts.password is not None:
        shown = parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}").geturl()
        problem = f"{shown!r} carries a user name or password, which would be saved in config.yaml and logged"
        return problem, (f"drop the `user:password@` part and give the key in the environment: {API_KEY_ENV} for the "
                         f"vLLM servers and the adapter receivers (the servers get it as VLLM_API_KEY); the rollout "
                         f"link's key is {ROLLOUT_KEY_ENV}")
    return None


def split_address(address, *, any_port: bool = False) -> tuple[str, int]:
    """`"host:port"` -> (host, port), for `rollout_address` and `rollout-serve --listen` (`any_port`: port 0, a free
    one, is allowed). Raises ValueError saying what is wrong, worded to follow the quoted value."""
    if not isinstance(address, str):
        raise ValueError(f"is a {type(address).__name__}, not a HOST:PORT string")
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host:
        raise ValueError("is not of the form HOST:PORT")
    if ":" in host or host.startswith("["):
        raise ValueError("is an IPv6 address; the rollout connection takes IPv4 addresses and host names only")
    if not port.isdigit() or not (0 if any_port else 1) <= int(port) <= 65535:
        raise ValueError(f"has port {port!r}, not a number from {0 if any_port else 1} to 65535")
    return host, int(port)


def parse_overrides(args: list[str]) -> dict:
    """Command-line overrides in the forms TRL's parser (transformers' HfArgumentParser) accepts -> {key: value}:
    `--key value` and `--key=value`; a boolean key alone is true (`--use_peft`), `--no_key` false, and its value may be
    HF's yes/no/true/false/1/0; a list key takes every value up to the next `--key` (`--lora_target_modules q_proj
    v_proj`, or `q_proj,v_proj`); `--per-device-train-batch-size` is `--per_device_train_batch_size`. Values are
    read as YAML (`{a: 1}`, `[a, b]`, `1e-5`) and coerced to the key's type later."""
    out: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(arg, "is not an override", "write overrides as `--key value`, `--key=value`, or a "
                              "boolean key alone (`--use_peft`); a list key takes several values (`--lora_target_"
                              "modules q_proj v_proj`)")
        key, inline, raw = arg[2:].partition("=")
        key = key.replace("-", "_")
        if inline:
            values, i = [raw], i + 1
        else:
            end = next((j for j in range(i + 1, len(args)) if args[j].startswith("--")), len(args))
            values, i = args[i + 1:end], end
        kind = _override_kind(key)
        if kind is None and key.startswith("no_") and _override_kind(key[3:]) == "bool":
            if values:
                raise ConfigError(key, f"takes no value, got {' '.join(values)!r}", f"write `--{key}` alone")
            out[key[3:]] = False  # HfArgumentParser's `--no_X` for a boolean X
        elif not values:
            if kind not in ("bool", None):  # an unknown key alone reads as a flag, reported as unknown later
                raise ConfigError(key, "override has no value", f"write `--{key} VALUE`")
            out[key] = True
        elif kind == "bool":
            if len(values) > 1:
                raise ConfigError(key, f"takes one value, got {' '.join(values)!r}", f"write `--{key}` or `--{key} "
                                  "false`")
            out[key] = _flag_value(key, values[0])
        elif len(values) > 1:
            if kind != "list" and kind is not None:
                raise ConfigError(key, f"takes one value, got {len(values)}: {' '.join(values)!r}",
                                  f"write `--{key} VALUE` (only list keys take several), quoting a value with spaces")
            out[key] = [_override_value(key, v) for v in values]
        else:
            out[key] = _override_value(key, values[0])
    return out


# HfArgumentParser's `string_to_bool`: the words a boolean override may be.
_TRUE_WORDS, _FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


def _flag_value(key: str, raw: str) -> bool:
    word = raw.strip().lower()
    if word in _TRUE_WORDS or word in _FALSE_WORDS:
        return word in _TRUE_WORDS
    raise ConfigError(key, f"expected true or false, got {raw!r}", f"write `--{key}` alone (true), `--{key} false` "
                      f"or `--no_{key}`")


def _override_value(key: str, raw: str):
    try:
        return yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as exc:
        raise ConfigError(key, f"override value {raw!r} is not valid YAML ({_yaml_problem(exc)})",
                          f"quote it for the shell, e.g. --{key} '{{name: value}}' or --{key} '[a, b]'") from None


def _override_kind(key: str) -> str | None:
    """`bool`, `list` or `value` for a key this project or the TRL layer reads; None for an unknown key."""
    key = trl_compat.ALIASES.get(key, key)
    if key in trl_compat.BOOLEAN_KEYS:
        return "bool"
    hint = typing.get_type_hints(AsyncGRPOConfig).get(key)
    if hint is None:
        return None
    if hint is bool:
        return "bool"
    kinds = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return "list" if any(typing.get_origin(k) is list for k in kinds) else "value"


def _is_function_ref(ref: str) -> bool:
    """`package.module:function`: dotted Python names on both sides of the one `:`."""
    module, _, name = ref.partition(":")
    return all(part.isidentifier() for part in [*module.split("."), *name.split(".")])


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what is wrong and where (line and column, 1-based)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _coerce(key: str, value, hint):
    """Check/convert one value against its type hint; a mismatch names the key and the expected type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if isinstance(value, bool) and bool in inner:
            return value  # `str | bool` (scale_rewards): TRL's true/false
        lists = [a for a in inner if typing.get_origin(a) is list]
        if lists and (isinstance(value, list) or (isinstance(value, str) and "," in value)):
            inner = lists  # `str | list[str]`: a YAML list, or `a,b` on the command line, picks the list
        return _coerce(key, value, inner[0])
    if hint is Any:
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}", f"write `{key}: {{name: value}}`")
        return {str(k): _coerce(key, v, args[1]) for k, v in value.items()}
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {value!r}", "write a YAML list or a comma-separated string")
        return [_coerce(key, v, args[0]) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {value!r}", f"write `{key}: true` or `{key}: false`")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected an integer, got {value!r}", f"write a whole number for {key}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads `1e-5` as a string
            except ValueError:
                pass
        raise ConfigError(key, f"expected a number, got {value!r}", f"write a number for {key}, e.g. 0.5")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(key, f"expected a string, got {value!r}", f"quote the value of {key}")
    raise AssertionError(f"unhandled type hint {hint!r} for {key}")


def field_docs() -> dict[str, str]:
    """Field name -> docstring, read from the sections' source, in their order (for docs/configuration.md and
    `--help`)."""
    docs = {}
    for section in SECTIONS:
        body = ast.parse(inspect.getsource(section)).body[0].body
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                    and isinstance(node.target, ast.Name) and node.target.id != node.target.id.upper():
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def reference() -> list[tuple[str, str, object, str]]:
    """(key, type, default, doc) of every field, in order: the one source of docs/configuration.md and of
    `asyncgrpo train --help`."""
    fields = AsyncGRPOConfig.__dataclass_fields__
    hints = typing.get_type_hints(AsyncGRPOConfig)
    rows = []
    for name, doc in field_docs().items():
        f = fields[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        rows.append((name, _type_name(hints[name]), default, doc))
    return rows


def _type_name(hint) -> str:
    """`str | list[str]`, `dict[str, Any] | None`, ... as a user reads them."""
    return str(hint).replace("typing.", "") if typing.get_origin(hint) else hint.__name__


def reference_markdown() -> str:
    """The config reference table for docs/configuration.md: `python -m asyncgrpo.config`."""
    rows = ["| key | type | default | what it does | TRL name |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{name}` | `{kind.replace('|', chr(92) + '|')}` | `{default}` | {doc} | "  # `\|`: not a cell edge
             f"{trl_compat.trl_name(name).replace('|', chr(92) + '|')} |" for name, kind, default, doc in reference()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
