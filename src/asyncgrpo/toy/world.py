"""The toy world: a tiny Qwen2 base model, warmed up so that GRPO has a clear, quickly learnable signal.

`build_toy_world()` returns a cached world or builds one (about half a minute on 2 CPU cores), offline and
deterministic from `ToyWorldSpec.seed`: a directory `toy-<key>/` with `model/` (HF model + tokenizer), `train.jsonl`,
`heldout.jsonl` and `world.json` (written last: the "complete" marker). Why the warm-up prefers the wrong operand,
and what GRPO then gains: docs/design.md ("The toy world").

Run `python -m asyncgrpo.toy.world [--seed N] [--cache-dir D]` to build or find a world and print its paths.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

try:
    from filelock import FileLock
except ImportError:  # filelock comes with huggingface_hub; without it, POSIX fcntl.flock does
    import fcntl

    FileLock = None

from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from asyncgrpo.errors import AsyncGRPOError, ConfigError
from asyncgrpo.toy.task import PROMPT_LENGTH, larger_reward, make_split
from asyncgrpo.toy.tokenizer import (
    EOS_ID,
    TOKENIZER_SIZE,
    build_tokenizer,
    decode_completion,
)

FORMAT_VERSION = 2
"""Bump when the world's layout or building code changes, so old caches are not reused."""

MAX_NEW_TOKENS = 3
"""An answer (2 digits) plus eos."""

Log = Callable[[str], Any]


class ToyWorldBuildError(AsyncGRPOError):
    """The warm-up did not produce a usable base model."""


@dataclass(frozen=True)
class WarmupSpec:
    """What every toy world has: its seeds, its supervised warm-up and its held-out split; `key()` names its cache
    directory. Subclasses add their shapes and set `format_version`."""

    seed: int = 0
    """Seeds the model init, the train/held-out split and the warm-up batches."""
    warmup_lr: float = 3e-3
    """AdamW learning rate for the supervised warm-up (no weight decay, no schedule)."""
    batch_size: int = 256
    """Warm-up examples per step, drawn without replacement within a step."""
    eval_every: int = 50
    """Warm-up steps between progress lines (held-out greedy and sampled figures)."""
    warmup_steps: int = 300
    """Supervised warm-up steps."""
    sample_seed: int = 1234
    """Seed of the sampled (temperature 1) evaluation of the base."""
    n_heldout: int = 500
    """Held-out examples; the rest are train."""
    format_version: ClassVar[int] = FORMAT_VERSION

    def __post_init__(self) -> None:
        """Reject a progress interval the warm-up never reaches."""
        if self.eval_every < 1 or self.warmup_steps < self.eval_every:
            raise ConfigError("eval_every", f"{self.eval_every} with warmup_steps={self.warmup_steps}",
                              "use 1 <= eval_every <= warmup_steps")

    def key(self) -> str:
        """A short hex digest of every field and the format version: equal keys mean interchangeable worlds."""
        fields = {**dataclasses.asdict(self), "format_version": self.format_version}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ToyWorldSpec(WarmupSpec):
    """The toy world's model shapes and warm-up target mix (the format and the two candidates are learned in
    about 200 warm-up steps; `n_heldout` of the 10,000 pairs are held out)."""

    hidden: int = 128
    """Hidden size; must equal heads * head_dim."""
    intermediate: int = 256
    """MLP inner size."""
    layers: int = 2
    """Decoder layers."""
    heads: int = 4
    """Attention (query) heads."""
    kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide heads."""
    head_dim: int = 32
    """Per-head size."""
    vocab: int = 320
    """Model vocabulary: the tokenizer's 259 ids padded to a multiple of 64."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas for the warm-up."""
    warmup_correct_fraction: float = 0.3
    """Probability that a warm-up target is the right answer (else the smaller number): the base's sampled
    success rate ends up near this value."""

    def __post_init__(self) -> None:
        """Reject shapes and knobs that cannot build a model or a split."""
        super().__post_init__()
        if self.hidden != self.heads * self.head_dim:
            raise ConfigError(
                "hidden", f"{self.hidden} != heads * head_dim = {self.heads} * {self.head_dim}",
                "set hidden = heads * head_dim (Qwen2 derives head_dim from them)",
            )
        if self.heads % self.kv_heads:
            raise ConfigError("kv_heads", f"{self.kv_heads} does not divide heads={self.heads}", "use a divisor")
        if self.vocab < TOKENIZER_SIZE:
            raise ConfigError("vocab", f"{self.vocab} < tokenizer size {TOKENIZER_SIZE}", "use 320")
        if not 0.0 < self.warmup_correct_fraction < 1.0:
            raise ConfigError("warmup_correct_fraction", f"must be in (0, 1), got {self.warmup_correct_fraction}",
                              "use e.g. 0.3")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ToyWorldSpec:
        """Inverse of `dataclasses.asdict` after a JSON round trip (lists back to tuples)."""
        return cls(**{**fields, "betas": tuple(fields["betas"])})


@dataclass
class ToyWorld:
    """A built toy world on disk. Paths are absolute."""

    root: Path
    model_dir: Path
    """HF model + tokenizer: `Qwen2ForCausalLM.from_pretrained(model_dir)`, `AutoTokenizer...`, vLLM `--model`."""
    train_file: Path
    """jsonl rows {"prompt", "answer"} for training."""
    heldout_file: Path
    """jsonl rows {"prompt", "answer"} for evaluation."""
    base_accuracy: float
    """Held-out greedy accuracy of the saved base model (exact match)."""
    base_sampled_accuracy: float
    """Held-out success rate of the saved base model sampling at temperature 1 (what GRPO starts from)."""
    spec: ToyWorldSpec
    warmup_steps: int = 0
    warmup_seconds: float = 0.0

    @classmethod
    def load(cls, root: Path) -> ToyWorld:
        """Read a complete world from `root` (the directory holding world.json)."""
        meta = json.loads((root / "world.json").read_text())
        return cls(
            root=root,
            model_dir=root / "model",
            train_file=root / "train.jsonl",
            heldout_file=root / "heldout.jsonl",
            base_accuracy=float(meta["base_accuracy"]),
            base_sampled_accuracy=float(meta["base_sampled_accuracy"]),
            spec=ToyWorldSpec.from_dict(meta["spec"]),
            warmup_steps=int(meta["warmup_steps"]),
            warmup_seconds=float(meta["warmup_seconds"]),
        )

    def read_rows(self, heldout: bool = False) -> list[dict[str, str]]:
        """The train (or held-out) rows."""
        return read_jsonl(self.heldout_file if heldout else self.train_file)


# ---------------------------------------------------------------------------------------------- model and decoding


def build_model(spec: ToyWorldSpec) -> torch.nn.Module:
    """A randomly initialised fp32 Qwen2ForCausalLM with the spec's shapes; seeds torch with `spec.seed` first."""
    config = Qwen2Config(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        use_cache=True,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        dtype="float32",
    )
    assert config.hidden_size // config.num_attention_heads == spec.head_dim  # Qwen2 derives head_dim this way
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return model


@torch.no_grad()
def decode(model: torch.nn.Module, prompt_ids: torch.Tensor, generator: torch.Generator | None = None,
           max_new_tokens: int = MAX_NEW_TOKENS) -> torch.Tensor:
    """Continue equal-length prompts with a KV cache: (N, P) ids -> (N, max_new_tokens) ids. Greedy without a
    `generator`, else sampled at temperature 1 from it. Keeps going after eos (callers cut at the first eos)."""
    was_training = model.training
    model.eval()
    past = None
    step_ids = prompt_ids  # (N, P) first, then (N, 1)
    generated = []
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :].float()  # (N, V)
        if generator is None:
            step_ids = logits.argmax(-1, keepdim=True)
        else:
            step_ids = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)  # (N, 1)
        generated.append(step_ids)
    model.train(was_training)
    return torch.cat(generated, dim=1)


def encode_prompts(tokenizer: Any, prompts: list[str]) -> torch.Tensor:
    """(N, 6) prompt ids; raises if a prompt is not the task's fixed 6 tokens."""
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    bad = [p for p, row in zip(prompts, ids) if len(row) != PROMPT_LENGTH]
    if bad:
        raise ValueError(f"toy prompts must be {PROMPT_LENGTH} tokens like '07+45=', got {bad[:3]}")
    return torch.tensor(ids, dtype=torch.long)


def heldout_accuracy(model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, str]],
                     generator: torch.Generator | None = None, chunk: int = 1000) -> float:
    """Mean reward of one completion per row: greedy, or sampled at temperature 1 with `generator`."""
    rewards: list[float] = []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        generated = decode(model, encode_prompts(tokenizer, [r["prompt"] for r in part]), generator)
        completions = [decode_completion(tokenizer, ids) for ids in generated.tolist()]
        rewards += larger_reward([r["prompt"] for r in part], completions, [r["answer"] for r in part])
    return sum(rewards) / len(rewards)


# ---------------------------------------------------------------------------------------------- supervised warm-up


def encode_examples(tokenizer: Any, rows: list[dict[str, str]], column: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels for every row with `column` ("answer" or "distractor") as the target: (N, 6 + 2 + 1).

    Sequence = prompt + target + eos. Labels are -100 except at the positions that predict the target tokens and
    the eos, so the loss trains only the answer.
    """
    targets = tokenizer([r[column] for r in rows], add_special_tokens=False)["input_ids"]
    prompts = encode_prompts(tokenizer, [r["prompt"] for r in rows]).tolist()
    assert len({len(t) for t in targets}) == 1, "toy targets are all 2 digits"
    sequences = torch.tensor([p + t + [EOS_ID] for p, t in zip(prompts, targets)])  # (N, L)
    labels = torch.full_like(sequences, -100)
    labels[:, PROMPT_LENGTH - 1 : -1] = sequences[:, PROMPT_LENGTH:]  # position t predicts token t + 1
    return sequences, labels


def warm_up(model: torch.nn.Module, tokenizer: Any, train_rows: list[dict[str, str]],
            heldout_rows: list[dict[str, str]], spec: ToyWorldSpec, log: Log) -> float:
    """`spec.warmup_steps` supervised steps whose target is the right answer with probability
    `spec.warmup_correct_fraction` and the distractor otherwise. Returns the seconds taken."""
    right, right_labels = encode_examples(tokenizer, train_rows, "answer")
    wrong, wrong_labels = encode_examples(tokenizer, train_rows, "distractor")
    draws = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warmup_lr, betas=spec.betas, weight_decay=0.0)
    model.train()
    start = time.perf_counter()
    for step in range(1, spec.warmup_steps + 1):
        index = torch.randperm(len(right), generator=draws)[: spec.batch_size]
        use_right = (torch.rand(len(index), generator=draws) < spec.warmup_correct_fraction).unsqueeze(1)  # (B, 1)
        inputs = torch.where(use_right, right[index], wrong[index])
        labels = torch.where(use_right, right_labels[index], wrong_labels[index])
        logits = model(input_ids=inputs).logits  # (B, L, V)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % spec.eval_every == 0:
            greedy = heldout_accuracy(model, tokenizer, heldout_rows)
            sampled = heldout_accuracy(model, tokenizer, heldout_rows, torch.Generator().manual_seed(spec.sample_seed))
            log(f"toy warm-up step {step:4d}  loss {loss.item():.4f}  held-out accuracy: greedy {greedy:.3f}, "
                f"sampled {sampled:.3f}  {time.perf_counter() - start:5.1f}s")
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- building and caching


def default_cache_dir() -> Path:
    """`$ASYNCGRPO_CACHE`, else `~/.cache/asyncgrpo`."""
    return Path(os.environ.get("ASYNCGRPO_CACHE") or Path.home() / ".cache" / "asyncgrpo")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a world's jsonl file (either world's train or held-out split)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    """One JSON object per line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _make_readable(directory: Path) -> None:
    """Let other users (an inference server in another account) read the world: mkdtemp creates it 0700."""
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _build_into(directory: Path, spec: ToyWorldSpec, log: Log) -> None:
    """Build a complete world inside `directory` (empty, exists); world.json is written last."""
    tokenizer = build_tokenizer()
    train_rows, heldout_rows = make_split(spec.seed, spec.n_heldout)
    model = build_model(spec)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"toy world {spec.key()}: warming up a {n_params:,}-parameter Qwen2 (seed {spec.seed}) for "
        f"{spec.warmup_steps} steps, right answer in {spec.warmup_correct_fraction:.0%} of the targets")
    seconds = warm_up(model, tokenizer, train_rows, heldout_rows, spec, log)
    # Measure what is saved, the way any user of the world will.
    base_accuracy = heldout_accuracy(model, tokenizer, heldout_rows)
    base_sampled = heldout_accuracy(model, tokenizer, heldout_rows, torch.Generator().manual_seed(spec.sample_seed))
    if not 0.05 <= base_sampled <= 0.5:
        raise ToyWorldBuildError(
            f"the warmed-up base succeeds on {base_sampled:.3f} of held-out prompts when sampling; a usable base is "
            f"between 0.05 and 0.5. Fix: change warmup_correct_fraction ({spec.warmup_correct_fraction}) or "
            f"warmup_steps ({spec.warmup_steps}), or try another seed (got {spec.seed})")
    model.config.use_cache = True
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    _write_jsonl(directory / "train.jsonl", train_rows)
    _write_jsonl(directory / "heldout.jsonl", heldout_rows)
    meta = {
        "format_version": FORMAT_VERSION,
        "key": spec.key(),
        "spec": dataclasses.asdict(spec),
        "base_accuracy": base_accuracy,
        "base_sampled_accuracy": base_sampled,
        "warmup_steps": spec.warmup_steps,
        "warmup_seconds": round(seconds, 2),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    (directory / "world.json").write_text(json.dumps(meta, indent=2) + "\n")


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an inter-process lock on `path` (filelock if installed, else fcntl.flock)."""
    if FileLock is None:
        with open(path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return
    with FileLock(str(path)):
        yield


def _remove_debris(cache: Path, root: Path, log: Log) -> None:
    """Delete what killed builds of `root` left behind. Call only while holding its lock."""
    debris = [p for p in cache.glob(f".{root.name}-*") if p.is_dir()]
    if root.exists():  # a root without its completion marker never completed
        debris.append(root)
    for path in debris:
        log(f"removing incomplete {path}")
        shutil.rmtree(path)


def build_cached(root: Path, build_into: Callable[[Path], None], log: Log, marker: str = "world.json") -> None:
    """Build `root` (a directory whose file `marker`, written last by `build_into`, marks it complete) unless it is
    complete already.

    Safe against concurrent callers: one builds (`build_into` fills a temp directory beside `root`, renamed into
    place when complete) while the others wait on a lock and then find it built.
    """
    root.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root.with_name(root.name + ".lock")):
        if (root / marker).is_file():  # another process built it while we waited
            return
        _remove_debris(root.parent, root, log)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
        try:
            build_into(staging)
            _make_readable(staging)
            os.rename(staging, root)  # atomic on one filesystem: readers see no world or a complete one
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def build_toy_world(
    spec: ToyWorldSpec | None = None, cache_dir: str | Path | None = None, log: Log = print
) -> ToyWorld:
    """Return the toy world for `spec` from `cache_dir/toy-<key>`, building it first if it is not there.

    Safe against concurrent callers: one builds (into a temp directory, renamed into place when complete) while
    the others wait on a lock and then load its result.
    """
    spec = spec or ToyWorldSpec()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = (cache / f"toy-{spec.key()}").resolve()
    if (root / "world.json").is_file():
        return ToyWorld.load(root)
    build_cached(root, lambda staging: _build_into(staging, spec, log), log)
    world = ToyWorld.load(root)
    log(f"toy world ready at {root}: base held-out accuracy greedy {world.base_accuracy:.3f}, sampled "
        f"{world.base_sampled_accuracy:.3f}, after {world.warmup_steps} warm-up steps ({world.warmup_seconds:.1f}s)")
    return world


QWEN_INSTRUCT_SAMPLING = {"top_k": 20, "repetition_penalty": 1.05}
"""Sampling defaults Qwen2.5-Instruct ships in its generation_config.json (with temperature and top_p, which every
request sets anyway): a server that applies them samples from a truncated, penalised distribution."""


def with_generation_defaults(world: ToyWorld, defaults: dict[str, Any] | None = None) -> ToyWorld:
    """A variant of `world` whose model directory also holds a generation_config.json with sampling `defaults`
    (default: QWEN_INSTRUCT_SAMPLING), the way real instruct checkpoints ship one. Same weights, tokenizer and
    data files; the default world's directory and cache key are untouched. Built once beside the world as
    `<root>-gen-<digest>/model` (a copy of the 1.4 MB model directory), atomically like the world itself."""
    defaults = dict(QWEN_INSTRUCT_SAMPLING if defaults is None else defaults)
    digest = hashlib.sha256(json.dumps(defaults, sort_keys=True).encode()).hexdigest()[:8]
    root = world.root.with_name(f"{world.root.name}-gen-{digest}")
    if not (root / "model" / "generation_config.json").is_file():
        with _exclusive_lock(root.with_name(root.name + ".lock")):
            if not (root / "model" / "generation_config.json").is_file():
                shutil.rmtree(root, ignore_errors=True)  # debris of a killed build
                staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
                try:
                    shutil.copytree(world.model_dir, staging / "model")
                    base = world.model_dir / "generation_config.json"
                    generation = json.loads(base.read_text()) if base.is_file() else {}
                    generation.update(defaults, do_sample=True)
                    (staging / "model" / "generation_config.json").write_text(json.dumps(generation, indent=2))
                    _make_readable(staging)
                    os.rename(staging, root)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
    return dataclasses.replace(world, model_dir=root / "model")


def main(argv: list[str] | None = None) -> None:
    """CLI: build or find the toy world; progress goes to stderr, its paths and base accuracy as JSON to stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=ToyWorldSpec.seed, help="model init / split / batch seed")
    parser.add_argument("--cache-dir", default=None, help="default: $ASYNCGRPO_CACHE or ~/.cache/asyncgrpo")
    args = parser.parse_args(argv)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # stdout carries only the JSON
    world = build_toy_world(ToyWorldSpec(seed=args.seed), args.cache_dir, log=progress)
    summary = {
        "root": str(world.root),
        "model_dir": str(world.model_dir),
        "train_file": str(world.train_file),
        "heldout_file": str(world.heldout_file),
        "base_accuracy": world.base_accuracy,
        "base_sampled_accuracy": world.base_sampled_accuracy,
        "warmup_steps": world.warmup_steps,
        "warmup_seconds": world.warmup_seconds,
        "key": world.spec.key(),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
