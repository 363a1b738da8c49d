"""The toy agent world: the toy Qwen2 warmed up to walk a hidden chain with a `lookup()` tool, often stopping early.

`build_agent_world()` returns a cached world or builds one (minutes on 2 busy CPU cores), offline and deterministic
from `AgentWorldSpec.seed`: `agent-<key>/` holds `model/` (HF model + tokenizer with the chat and response
templates), `train.jsonl`, `heldout.jsonl` and `world.json` (written last). `heldout_success` plays whole episodes
with HF generate and `LookupEnv`: the check of the base (and of a trained adapter) that needs no inference server.
Why the warm-up makes mistakes on purpose: docs/agents.md ("The toy agent world").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.agent_chat import build_agent_tokenizer
from asyncgrpo.toy.agent_episodes import AgentEval, heldout_success, warmup_batch
from asyncgrpo.toy.agent_task import make_agent_split
from asyncgrpo.toy.tokenizer import EOS_ID, IM_END_TOKEN, SPECIAL_TOKENS
from asyncgrpo.toy.world import (
    Log,
    ToyWorldBuildError,
    ToyWorldSpec,
    WarmupSpec,
    build_cached,
    build_model,
    default_cache_dir,
    read_jsonl,
)

FORMAT_VERSION = 2
"""Bump when the agent world's layout or building code changes, so old caches are not reused."""

IM_END_ID = SPECIAL_TOKENS.index(IM_END_TOKEN)


@dataclass(frozen=True)
class AgentWorldSpec(WarmupSpec):
    """Everything that decides the agent world's contents (the seed also draws the table and the warm-up
    episodes; `n_heldout` of the table's 300 chains are held out); `key()` names its cache directory."""

    batch_size: int = 64
    eval_every: int = 100
    warmup_steps: int = 200
    n_heldout: int = 100
    hidden: int = 128
    """Hidden size of the toy Qwen2 (the toy world's shapes; see ToyWorldSpec)."""
    layers: int = 2
    """Decoder layers."""
    stop_early_prob: float = 0.3
    """Warm-up: chance, before each call, that the episode stops and answers the last key it read or a guess."""
    guess_prob: float = 0.1
    """Warm-up: chance that an episode that read the value answers a guessed value instead."""
    format_version: ClassVar[int] = FORMAT_VERSION

    def __post_init__(self) -> None:
        """Reject probabilities that leave nothing to learn or nothing to improve."""
        super().__post_init__()
        for name in ("stop_early_prob", "guess_prob"):
            if not 0.0 <= getattr(self, name) < 0.5:
                raise ConfigError(name, f"must be in [0, 0.5), got {getattr(self, name)}", "use e.g. 0.2")

    def model_spec(self) -> ToyWorldSpec:
        """The toy world's model shapes at this hidden size and depth (heads of 32)."""
        return ToyWorldSpec(seed=self.seed, hidden=self.hidden, intermediate=2 * self.hidden, layers=self.layers,
                            heads=self.hidden // 32, kv_heads=max(1, self.hidden // 64), head_dim=32)


@dataclass
class AgentWorld:
    """A built toy agent world on disk. Paths are absolute."""

    root: Path
    model_dir: Path
    """HF model + tokenizer (chat template and response_template included), vLLM `--model`."""
    train_file: Path
    """jsonl rows {"prompt": [user message], "answer", "key", "hops", "world_seed"}."""
    heldout_file: Path
    """jsonl rows like train_file's, from chains that training never sees."""
    base_greedy: dict[str, float]
    """Held-out episode figures of the saved base, greedy (AgentEval fields)."""
    base_sampled: dict[str, float]
    """The same sampling at temperature 1: what RL starts from."""
    spec: AgentWorldSpec
    warmup_seconds: float = 0.0

    @classmethod
    def load(cls, root: Path) -> AgentWorld:
        """Read a complete world from `root` (the directory holding world.json)."""
        meta = json.loads((root / "world.json").read_text())
        return cls(root=root, model_dir=root / "model", train_file=root / "train.jsonl",
                   heldout_file=root / "heldout.jsonl", base_greedy=meta["base_greedy"],
                   base_sampled=meta["base_sampled"], spec=AgentWorldSpec(**meta["spec"]),
                   warmup_seconds=float(meta["warmup_seconds"]))

    def read_rows(self, heldout: bool = False) -> list[dict[str, Any]]:
        """The train (or held-out) rows."""
        return read_jsonl(self.heldout_file if heldout else self.train_file)


def build_agent_model(spec: AgentWorldSpec) -> torch.nn.Module:
    """The toy Qwen2 (random init from `spec.seed`) whose generation stops at `<|im_end|>`, the end of a turn."""
    model = build_model(spec.model_spec())
    model.config.eos_token_id = IM_END_ID
    model.generation_config = GenerationConfig(bos_token_id=EOS_ID, eos_token_id=[IM_END_ID, EOS_ID],
                                               pad_token_id=EOS_ID)
    return model


def warm_up(model: torch.nn.Module, tokenizer: Any, heldout_rows: list[dict[str, Any]], spec: AgentWorldSpec,
            log: Log) -> float:
    """`spec.warmup_steps` supervised steps on freshly drawn episodes (random keys, not the world's table), loss
    on the assistant tokens only. Returns the seconds taken."""
    rng = random.Random(f"agent-warmup-{spec.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.warmup_lr, betas=(0.9, 0.98), weight_decay=0.0)
    start = time.perf_counter()
    for step in range(1, spec.warmup_steps + 1):
        model.train()
        inputs, labels = warmup_batch(tokenizer, rng, spec.batch_size, spec.stop_early_prob, spec.guess_prob)
        logits = model(input_ids=inputs).logits  # (B, L, V); right padding, so no mask is needed (causal)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % spec.eval_every == 0:
            sampled = heldout_success(model, tokenizer, heldout_rows, seed=spec.sample_seed)
            log(f"agent warm-up step {step:4d}  loss {loss.item():.4f}  held-out success (sampled) "
                f"{sampled.success:.3f}, turns {sampled.turns_mean:.2f}  {time.perf_counter() - start:5.1f}s")
    return time.perf_counter() - start


def _build_into(directory: Path, spec: AgentWorldSpec, log: Log) -> None:
    """Build a complete agent world inside `directory` (empty, exists); world.json is written last."""
    tokenizer = build_agent_tokenizer()
    train_rows, heldout_rows = make_agent_split(spec.seed, spec.n_heldout)
    model = build_agent_model(spec)
    log(f"agent world {spec.key()}: warming up a {sum(p.numel() for p in model.parameters()):,}-parameter Qwen2 "
        f"(seed {spec.seed}) for {spec.warmup_steps} steps on tool-calling episodes")
    seconds = warm_up(model, tokenizer, heldout_rows, spec, log)
    greedy = heldout_success(model, tokenizer, heldout_rows)
    sampled = heldout_success(model, tokenizer, heldout_rows, seed=spec.sample_seed)
    if not (0.05 <= sampled.success <= 0.7 and sampled.tool_calls_mean >= 0.5):
        raise ToyWorldBuildError(
            f"the warmed-up agent base succeeds on {sampled.success:.3f} of held-out questions when sampling, with "
            f"{sampled.tool_calls_mean:.2f} tool calls per episode; a usable base is between 0.05 and 0.7 and calls "
            f"tools. Fix: change stop_early_prob / guess_prob or warmup_steps ({spec.warmup_steps}), or try "
            f"another seed (got {spec.seed})")
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    for name, rows in (("train.jsonl", train_rows), ("heldout.jsonl", heldout_rows)):
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"format_version": FORMAT_VERSION, "key": spec.key(), "spec": dataclasses.asdict(spec),
            "base_greedy": dataclasses.asdict(greedy), "base_sampled": dataclasses.asdict(sampled),
            "warmup_seconds": round(seconds, 2), "torch_version": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    (directory / "world.json").write_text(json.dumps(meta, indent=2) + "\n")


def build_agent_world(spec: AgentWorldSpec | None = None, cache_dir: str | Path | None = None,
                      log: Log = print) -> AgentWorld:
    """Return the agent world for `spec` from `cache_dir/agent-<key>`, building it first if it is not there (safe
    against concurrent callers, like build_toy_world)."""
    spec = spec or AgentWorldSpec()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = (cache / f"agent-{spec.key()}").resolve()
    if not (root / "world.json").is_file():
        build_cached(root, lambda staging: _build_into(staging, spec, log), log)
        world = AgentWorld.load(root)
        log(f"agent world ready at {root}: base held-out success greedy {world.base_greedy['success']:.3f}, "
            f"sampled {world.base_sampled['success']:.3f} ({world.warmup_seconds:.1f}s of warm-up)")
    return AgentWorld.load(root)


def main(argv: list[str] | None = None) -> None:
    """CLI: build or find the agent world; progress goes to stderr, its paths and base figures as JSON to stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=AgentWorldSpec.seed, help="table / split / model seed")
    parser.add_argument("--cache-dir", default=None, help="default: $ASYNCGRPO_CACHE or ~/.cache/asyncgrpo")
    args = parser.parse_args(argv)
    world = build_agent_world(AgentWorldSpec(seed=args.seed), args.cache_dir,
                              log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps({"root": str(world.root), "model_dir": str(world.model_dir), "train_file": str(world.train_file),
                      "heldout_file": str(world.heldout_file), "base_greedy": world.base_greedy,
                      "base_sampled": world.base_sampled, "warmup_seconds": world.warmup_seconds,
                      "key": world.spec.key()}, indent=2))


__all__ = ["AgentEval", "AgentWorld", "AgentWorldSpec", "build_agent_world", "heldout_success"]

if __name__ == "__main__":
    main()
