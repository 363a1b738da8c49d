"""Prompt datasets: where prompts come from, how they become token ids, and the order they are used in.

    source (toy split | local json/jsonl/parquet/csv/arrow | hub dataset, through `datasets`)
      -> one prompt per row: plain text, or chat messages through the tokenizer's own chat template
      -> token ids, once; prompts too long for the server are skipped and counted
      -> PromptStream: endless, each epoch shuffled by (seed, epoch), so a position can be restored exactly

Every other column reaches the reward functions by name; chat prompts also get the tokenizer's response template.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from asyncgrpo.config import AgentSettings, DataSettings, EvalSettings, GenerationSettings, ModelSettings
from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.shapes import shape_model_dir

log = logging.getLogger(__name__)

FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""Local file suffix -> the `datasets` builder that reads it."""

RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "parsed")
"""Names reward functions already receive as arguments; a dataset column may not use them."""


@dataclass
class PromptSettings(DataSettings, ModelSettings, AgentSettings, GenerationSettings):
    """The sections the prompts are read with: the dataset and its columns, the model (the toy world's seed), the
    environment that gives prompts instead of a dataset, and max_completion_length (the room a prompt leaves)."""


@dataclass
class EvalPromptSettings(PromptSettings, EvalSettings):
    """The held-out prompts' sections: the training prompts' and eval_strategy/eval_dataset."""


@dataclass
class PromptRow:
    """A dataset row with its prompt already tokenised once.

    `prompt` is what reward functions receive as `prompts`: the text, or the chat messages (TRL's conversational
    format). `rendered` is the text sent for a chat prompt (chat template applied), None for a text prompt.
    """

    prompt: str | list[dict]
    prompt_ids: list[int]
    columns: dict
    rendered: str | None = None

    @property
    def is_chat(self) -> bool:
        return self.rendered is not None


@dataclass
class PromptSet:
    """The rows to train on, and what loading them found."""

    rows: list[PromptRow]
    source: str  # how the data was named, for messages
    total: int  # rows in the split, before skipping
    skipped_too_long: int = 0
    skipped_empty: int = 0
    max_prompt_length: int | None = None
    response_template: dict | None = None  # for parsing chat completions; None = no parsing


@dataclass
class PromptFormat:
    """How one row becomes a prompt (the config's prompt keys, gathered)."""

    prompt_column: str = "prompt"
    messages_column: str | None = None
    prompt_format: str = "auto"
    system_prompt: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: DataSettings) -> "PromptFormat":
        return cls(cfg.prompt_column, cfg.messages_column, cfg.prompt_format, cfg.system_prompt,
                   dict(cfg.chat_template_kwargs or {}))

    @property
    def column(self) -> str:
        return self.messages_column or self.prompt_column

    @property
    def column_key(self) -> str:
        return "messages_column" if self.messages_column else "prompt_column"


# ---- the toy world and the model path ------------------------------------------------------------------
def resolve_model_path(cfg: ModelSettings) -> str:
    """`model_name_or_path: toy` -> the cached toy model directory, `shape:<name>` -> the cached random-weight model
    of that checkpoint's shape in `torch_dtype` (each built on first use); anything else as given."""
    if cfg.model_name_or_path.startswith("shape:"):
        return shape_model_dir(cfg.model_name_or_path, cfg.torch_dtype)
    if cfg.model_name_or_path != "toy":
        return cfg.model_name_or_path
    return str(toy_world(cfg).model_dir)


def base_model_reference(model_path: str) -> str:
    """What an adapter records as `base_model_name_or_path`: a local directory as an absolute path (valid from any
    working directory), anything else, a hub id, exactly as the user wrote it."""
    return str(Path(model_path).resolve()) if Path(model_path).is_dir() else model_path


def local_model_dir(path: str) -> str:
    """A local directory holding the model `path` names: `path` itself when it is a directory, else its hub snapshot
    (downloaded unless cached; weights as safetensors or .bin, never the `original/` or GGUF copies some repos add)."""
    if Path(path).is_dir():
        return path
    # heavy: huggingface_hub's download machinery (~0.7 s), needed only for a hub model name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(path, ignore_patterns=["original/*", "*.gguf", "*.pth", "*.pt", "*.onnx", "*.h5",
                                                        "*.msgpack", "*.ot"])
    except LocalEntryNotFoundError as exc:
        raise ConfigError("model_name_or_path", f"{path!r} is not a local directory and not in the hub cache, and the "
                          "hub cannot be reached (offline)",
                          "pass a local model directory, or download it first with hub access "
                          "(`huggingface-cli download ...`)") from exc


def toy_world(cfg: ModelSettings):
    """The cached toy world of `cfg.toy_seed` (built on first use)."""
    from asyncgrpo.toy import ToyWorldSpec, build_toy_world  # heavy: the toy world imports torch and transformers

    return build_toy_world(ToyWorldSpec(seed=cfg.toy_seed))


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigError("dataset_name", f"{path}:{i} is not valid JSON ({exc})",
                                      "write one JSON object per line") from exc
    return rows


# ---- reading a split -------------------------------------------------------------------------------------
def count_training_rows(cfg: PromptSettings) -> int:
    """Rows of the training split (for `num_train_epochs`)."""
    return len(read_records(cfg)[0])


ENVIRONMENT_DATA = "environment"  # dataset_name: no dataset; environment_factory's reset() gives each prompt (TRL)


def read_records(cfg: PromptSettings) -> tuple[list[dict], str]:
    """The training split as (rows, a description of where they came from, for messages). `dataset_name:
    environment` is TRL's run without a dataset: one row holding an empty user message, to which each episode's
    `reset()` text is appended (every group is then that row's `num_generations` episodes)."""
    if cfg.dataset_name == ENVIRONMENT_DATA:
        return [{PromptFormat.from_config(cfg).column: [{"role": "user", "content": ""}]}], \
            f"{cfg.environment_factory}'s reset() (dataset_name: {ENVIRONMENT_DATA})"
    if cfg.dataset_name == "toy":
        path = toy_world(cfg).train_file  # the toy split is small: read it directly, without `datasets`
        return read_jsonl(path), str(path)
    dataset, source = _load_split(cfg)
    return dataset.to_list(), source


def _load_split(cfg: DataSettings, split: str | None = None, key: str = "dataset_train_split"):
    """`datasets.load_dataset` (or `load_from_disk`) of the configured source's `split` (default: the training
    split); errors name the key to fix, `key` for a split the source does not have."""
    import datasets  # heavy: datasets, not needed for the toy split or by reward workers importing this module

    split = cfg.dataset_train_split if split is None else split
    name, files = cfg.dataset_name, cfg.data_files
    path = Path(name)
    kwargs: dict = {"split": split}
    if files is None and not path.exists() and (path.suffix in FORMATS or name.startswith(("./", "../", "/", "~"))):
        # A file path, not a hub id ("org/name" has no suffix): a missing file, not a hub access problem.
        raise ConfigError("dataset_name", f"file {name!r} does not exist (resolved to {str(path.absolute())!r}; "
                          f"relative paths start from the directory the run was launched in)",
                          "give the path of an existing file, absolute or relative to where you launch")
    if files is None and path.is_file():
        if path.suffix not in FORMATS:
            raise ConfigError("dataset_name", f"{name!r} is a {path.suffix or 'suffix-less'} file",
                              f"use a file ending in one of {', '.join(FORMATS)}")
        name, files = FORMATS[path.suffix], [str(path)]
    elif files is None and any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json")):
        return _split_from_disk(path, split, key), str(path)
    elif files is not None:
        missing = [f for f in files if not Path(f).exists() and "*" not in f]
        if missing and name in FORMATS.values():
            raise ConfigError("data_files", f"{missing} do not exist", "give paths to existing local files")
    if files is not None:
        kwargs["data_files"] = list(files)
    what = f"{name}" + (f" ({', '.join(files)})" if files else "") + (
        f" config {cfg.dataset_config!r}" if cfg.dataset_config else "")
    source = f"{what} split {split!r}"
    try:
        dataset = datasets.load_dataset(name, cfg.dataset_config, **kwargs)
    except ValueError as exc:  # an unknown split or config: datasets lists the ones that exist
        if "split" not in str(exc):
            raise ConfigError("dataset_config", f"cannot load {source}: {exc}",
                              "pick one of the names the message lists") from exc
        raise _unknown_split(key, split, what, _split_names(name, cfg.dataset_config, kwargs), exc) from exc
    except Exception as exc:  # noqa: BLE001 - datasets raises many types (offline, not found, bad files)
        raise ConfigError("dataset_name", f"cannot load {source}: {type(exc).__name__}: {exc}",
                          "check the name (hub access needed for hub datasets), or point dataset_name at a "
                          "local file") from exc
    return dataset, source


def _split_names(name: str, config: str | None, kwargs: dict) -> list[str] | None:
    """The splits `datasets` finds for a source (None when it cannot say)."""
    import datasets  # heavy: see _load_split

    try:
        return list(datasets.get_dataset_split_names(name, config, data_files=kwargs.get("data_files")))
    except Exception:  # noqa: BLE001 - only for the message: the caller still has datasets' own
        return None


def _unknown_split(key: str, split: str, source: str, splits: list[str] | None, exc=None) -> ConfigError:
    """The error for a split the source does not have, naming those it has."""
    found = f"its splits: {splits}" if splits is not None else f"datasets says: {exc}"
    fix = f"set {key} to one of those"
    if key == "dataset_test_split":
        fix += (", or name held-out prompts with eval_dataset (a local data file or `save_to_disk` directory, "
                "or `toy`)")
    return ConfigError(key, f"{split!r} is not a split of {source}; {found}", fix)


def _split_from_disk(path: Path, split: str, key: str = "dataset_train_split"):
    import datasets  # heavy: see _load_split

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise _unknown_split(key, split, str(path), list(loaded))
        return loaded[split]
    if key == "dataset_test_split":  # one saved Dataset is a single split: nothing held out in it
        raise ConfigError(key, f"{split!r} is not a split of {path}: it holds one `Dataset` (no splits), the "
                          f"training prompts", "save a `DatasetDict` with a test split, or name held-out prompts "
                          "with eval_dataset (a local data file or `save_to_disk` directory)")
    return loaded


# ---- rows -> prompts ---------------------------------------------------------------------------------------
def check_columns(columns: list[str], fmt: PromptFormat, source: str) -> None:
    """The prompt column must exist; no other column may shadow a reward-function argument."""
    if fmt.column not in columns:
        raise ConfigError(fmt.column_key, f"{fmt.column!r} is not a column of {source}; columns: {sorted(columns)}",
                          f"set {fmt.column_key} to one of those")
    clash = sorted(set(columns) - {fmt.column} & set(RESERVED_COLUMNS))
    if clash:
        raise ConfigError("dataset_name", f"{source} has column(s) {clash}, names reward functions already get as "
                          f"arguments ({', '.join(RESERVED_COLUMNS)})",
                          "rename those columns (datasets: `rename_column`) and the reward functions' arguments")


def _messages(value, i: int, fmt: PromptFormat, source: str) -> list[dict] | None:
    """The row's prompt as chat messages, or None when it is plain text used as written."""
    if isinstance(value, str):
        if fmt.messages_column:
            raise ConfigError("messages_column", f"row {i} of {source} holds text in {fmt.column!r}, not messages",
                              "point messages_column at a column of [{role, content}] lists, or use prompt_column")
        if fmt.prompt_format != "chat":
            if fmt.system_prompt is not None:
                raise ConfigError("system_prompt", "is set but the prompts are plain text used as written",
                                  "set `prompt_format: chat` to wrap each prompt as a user message")
            return None
        return [{"role": "user", "content": value}]
    ok = isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in value)
    if not ok:
        raise ConfigError(fmt.column_key, f"row {i} of {source}: {fmt.column!r} holds {str(value)[:80]!r}",
                          "each prompt must be a string or a non-empty list of {role, content} messages")
    if fmt.prompt_format == "raw":
        raise ConfigError("prompt_format", f"is raw but {fmt.column!r} holds chat messages",
                          "use `prompt_format: auto` (or chat) so that they go through the chat template")
    return list(value)


def render_chat(tokenizer, messages: list[dict], fmt: PromptFormat) -> str:
    """The text of a chat prompt: system prompt first if the messages have none, the tokenizer's own chat template,
    and the assistant turn opened (`add_generation_prompt`)."""
    if tokenizer.chat_template is None:
        raise ConfigError("prompt_format", f"the tokenizer {tokenizer.name_or_path!r} has no chat template",
                          "use plain-text prompts with `prompt_format: raw`, or a model whose tokenizer has one")
    if fmt.system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": fmt.system_prompt}, *messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **fmt.chat_template_kwargs)


def build_rows(records: list[dict], tokenizer, fmt: PromptFormat, *, source: str,
               max_prompt_length: int | None = None) -> PromptSet:
    """Tokenise every prompt once; skip (and count) empty prompts and prompts longer than `max_prompt_length`."""
    if not records:
        raise ConfigError("dataset_name", f"{source} has no rows", "use a split with at least one prompt")
    check_columns(list(records[0]), fmt, source)
    prompts, texts, rendered = [], [], []
    for i, record in enumerate(records):
        value = record[fmt.column]
        messages = _messages(value, i, fmt, source)
        chat_text = None if messages is None else render_chat(tokenizer, messages, fmt)
        prompts.append(value if messages is None else messages)  # reward functions get the messages
        texts.append(value if chat_text is None else chat_text)
        rendered.append(chat_text)
    # Chat templates write their own bos. verbose=False: over-long prompts are counted below, not warned about.
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    out = PromptSet(rows=[], source=source, total=len(records), max_prompt_length=max_prompt_length)
    for record, prompt, prompt_ids, chat_text in zip(records, prompts, ids, rendered):
        if not prompt_ids:
            out.skipped_empty += 1
        elif max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            out.skipped_too_long += 1
        else:
            columns = {k: v for k, v in record.items() if k != fmt.column}
            out.rows.append(PromptRow(prompt=prompt, prompt_ids=list(prompt_ids), columns=columns, rendered=chat_text))
    if not out.rows:
        raise ConfigError("max_prompt_length", f"all {out.total} prompts of {source} are empty or longer than "
                          f"{max_prompt_length} tokens", "raise max_prompt_length / the server's --max-model-len, "
                          "or lower max_completion_length")
    return out


def prompt_length_limit(cfg: PromptSettings, server_max_model_len: int | None) -> int | None:
    """The longest prompt the server can take while leaving `max_completion_length` tokens to generate."""
    limits = [cfg.max_prompt_length] if cfg.max_prompt_length else []
    if server_max_model_len is not None:
        room = server_max_model_len - cfg.max_completion_length
        if room < 1:
            raise ConfigError("max_completion_length", f"{cfg.max_completion_length} leaves no room for a prompt in "
                              f"the server's max_model_len ({server_max_model_len})",
                              "lower max_completion_length, or start the server with a larger --max-model-len")
        if cfg.max_prompt_length and cfg.max_prompt_length > room:
            log.warning("max_prompt_length %d + max_completion_length %d exceed the server's max_model_len %d; "
                        "prompts longer than %d tokens are skipped", cfg.max_prompt_length,
                        cfg.max_completion_length, server_max_model_len, room)
        limits.append(room)
    return min(limits) if limits else None


def server_max_model_len(models: list[dict]) -> int | None:
    """The base model's `max_model_len` from a `/v1/models` listing (None when the server does not say)."""
    for entry in models:
        if entry.get("parent") is None and entry.get("max_model_len"):
            return int(entry["max_model_len"])
    return None


def load_prompt_set(cfg: PromptSettings, tokenizer, *, server_max_model_len: int | None = None,
                    model_path: str | None = None) -> PromptSet:
    """The configured training split, tokenised, with over-long prompts skipped and counted (rank 0, at start)."""
    records, source = read_records(cfg)
    limit = prompt_length_limit(cfg, server_max_model_len)
    prompts = build_rows(records, tokenizer, PromptFormat.from_config(cfg), source=source, max_prompt_length=limit)
    if prompts.skipped_too_long or prompts.skipped_empty:
        log.warning("skipped %d of %d prompts of %s: %d longer than %s tokens, %d empty",
                    prompts.skipped_too_long + prompts.skipped_empty, prompts.total, source,
                    prompts.skipped_too_long, limit, prompts.skipped_empty)
    if cfg.parse_responses and any(r.is_chat for r in prompts.rows):
        prompts.response_template = response_template_for(tokenizer, model_type_of(model_path))
    return prompts


TOY_SPLITS = ("train", "test")  # the toy world's: its training prompts and its held-out ones


def read_test_split(cfg: PromptSettings) -> tuple[list[dict], str]:
    """The `dataset_test_split` split of `dataset_name` (TRL's script reads `dataset[dataset_test_split]`), as
    (rows, where they came from); `toy`'s are `train` and `test` (its held-out prompts). `dataset_name: environment`
    has none (config validation asks for eval_dataset)."""
    split = cfg.dataset_test_split
    if cfg.dataset_name == "toy":
        if split not in TOY_SPLITS:
            raise _unknown_split("dataset_test_split", split, "the toy dataset", list(TOY_SPLITS))
        path = toy_world(cfg).heldout_file if split == "test" else toy_world(cfg).train_file
        return read_jsonl(path), str(path)
    dataset, source = _load_split(cfg, split, key="dataset_test_split")
    return dataset.to_list(), source


def load_eval_prompts(cfg: EvalPromptSettings, tokenizer, *,
                      server_max_model_len: int | None = None) -> list[PromptRow]:
    """The held-out prompts of `eval_strategy: steps` (none with `no`), in the training data's prompt format:
    `eval_dataset` when set (`toy`: the toy world's held-out split; else a local file or `save_to_disk` directory,
    read as `dataset_name` would be), else the `dataset_test_split` split of `dataset_name` (`read_test_split`)."""
    if cfg.eval_strategy != "steps":
        return []
    if not cfg.eval_dataset:
        records, source = read_test_split(cfg)
    elif cfg.eval_dataset == "toy":
        records, source = read_jsonl(toy_world(cfg).heldout_file), str(toy_world(cfg).heldout_file)
    else:
        local = SimpleNamespace(dataset_name=cfg.eval_dataset, data_files=None, dataset_config=None,
                                dataset_train_split="train")  # local files are the `train` split
        if not Path(cfg.eval_dataset).exists():
            raise ConfigError("eval_dataset", f"{cfg.eval_dataset!r} does not exist",
                              "give a local data file or directory, or `toy`, or unset it to evaluate on "
                              "dataset_test_split")
        dataset, source = _load_split(local)
        records = dataset.to_list()
    limit = prompt_length_limit(cfg, server_max_model_len)
    return build_rows(records, tokenizer, PromptFormat.from_config(cfg), source=source, max_prompt_length=limit).rows


def load_prompts(path: Path, tokenizer, prompt_column: str = "prompt") -> list[PromptRow]:
    """Rows of a local jsonl file (the toy world's splits), plain-text prompts tokenised as written."""
    fmt = PromptFormat(prompt_column=prompt_column, prompt_format="raw")
    return build_rows(read_jsonl(path), tokenizer, fmt, source=str(path)).rows


# ---- parsed responses ----------------------------------------------------------------------------------------
def model_type_of(model_path: str | None) -> str | None:
    if model_path is None:
        return None
    from transformers import AutoConfig  # heavy: transformers, not needed by reward workers importing this module

    try:
        return AutoConfig.from_pretrained(model_path).model_type
    except (OSError, ValueError):
        return None


def response_template_for(tokenizer, model_type: str | None = None) -> dict | None:
    """The tokenizer's own `response_template`, else the one transformers ships for `model_type` (its serving
    fallbacks: Qwen2/2.5/3, Gemma 4, ...), else None. Nothing here is parsed by hand."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None or model_type is None:
        return own
    try:
        from transformers.cli.serving.utils import get_response_template  # heavy: transformers (see model_type_of)
    except ImportError:  # the serving extras are not installed: no fallback
        return None
    return get_response_template(tokenizer, SimpleNamespace(config=SimpleNamespace(model_type=model_type)))


def parse_completions(tokenizer, template: dict, prefix: str, texts: list[str]) -> list[dict | None]:
    """`tokenizer.parse_response` on each completion (decoded with its special tokens, which close the regions);
    `prefix` is the rendered chat prompt, so a template that pre-writes part of the turn parses right.
    A completion the parser rejects (a policy can write anything) gets None."""
    out: list[dict | None] = []
    for text in texts:
        try:
            out.append(tokenizer.parse_response(text, template, prefix=prefix))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.debug("parse_response failed on %r: %s", text[:200], exc)
            out.append(None)
    return out


# ---- the order -------------------------------------------------------------------------------------------------
class PromptStream:
    """Endless deterministic stream of rows: epoch e is the rows shuffled by (seed, e).

    `position` counts the rows handed out; a stream built with `start=position` continues at exactly that row,
    across epoch boundaries too (what resuming from a checkpoint needs).
    """

    def __init__(self, rows: list, seed: int, start: int = 0):
        assert rows, "a prompt stream needs at least one row"
        self.rows, self.seed, self.position = rows, seed, start
        self._epoch, self._order = -1, []

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    @property
    def epoch(self) -> int:
        return self.position // len(self.rows)

    def __iter__(self):
        return self

    def __next__(self):
        epoch, index = divmod(self.position, len(self.rows))
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.epoch_order(epoch)
        self.position += 1
        return self.rows[self._order[index]]
