"""Prompt datasets: the toy world's split, or a local jsonl file with a prompt column."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError
from .rollout.producer import PromptRow


def resolve_model_path(cfg) -> str:
    """`model_name_or_path: toy` -> the cached toy model directory (built on first use)."""
    if cfg.model_name_or_path != "toy":
        return cfg.model_name_or_path
    return str(toy_world(cfg).model_dir)


def toy_world(cfg):
    from .toy import ToyWorldSpec, build_toy_world

    return build_toy_world(ToyWorldSpec(seed=cfg.toy_seed))


def dataset_file(cfg, split: str = "train") -> Path:
    if cfg.dataset_name == "toy":
        world = toy_world(cfg)
        return world.train_file if split == "train" else world.heldout_file
    path = Path(cfg.dataset_name)
    if not path.is_file() or path.suffix != ".jsonl":
        raise ConfigError("dataset_name", f"{cfg.dataset_name!r} is not `toy` or an existing .jsonl file",
                          "point dataset_name at a local .jsonl file with one JSON object per line")
    return path


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


def load_prompts(path: Path, tokenizer, prompt_column: str = "prompt") -> list[PromptRow]:
    """Rows with their prompt tokenised once; every other column is kept for the reward functions."""
    rows = read_jsonl(path)
    if not rows:
        raise ConfigError("dataset_name", f"{path} has no rows", "use a file with at least one prompt")
    if prompt_column not in rows[0]:
        raise ConfigError("prompt_column", f"{prompt_column!r} is not a column of {path}; columns: "
                          f"{sorted(rows[0])}", "set prompt_column to one of those")
    out = []
    for row in rows:
        prompt = row[prompt_column]
        columns = {k: v for k, v in row.items() if k != prompt_column}
        out.append(PromptRow(prompt=prompt, prompt_ids=tokenizer(prompt, add_special_tokens=False)["input_ids"],
                             columns=columns))
    return out
