"""Real checkpoints' shapes with random weights: `model_name_or_path: shape:<name>` (or `bench ... --model shape:..`).

Each shape is the architecture config a published checkpoint ships (its config.json values), so memory, gather
bytes and step times are those of the real model; the weights are random (seeded) and the tokenizer is the toy's
byte-level one padded with never-produced filler tokens to the model's vocabulary size. Built once into
`$ASYNCGRPO_CACHE/shape-<name>-<dtype>/` (atomically, under a lock, like the toy world). docs/models.md lists them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigError

PREFIX = "shape:"
COMPLETE = "tokenizer.json"  # build_shape_model saves it last: a directory holding it is a complete build
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Shape:
    """One checkpoint's architecture: the transformers config class and the values its config.json sets."""

    checkpoint: str  # the hub id whose config.json these values come from (never downloaded)
    config_class: str
    model_class: str
    values: dict[str, Any] = field(default_factory=dict)
    parameters: int = 0  # the published checkpoint's parameter count (what a test checks the shape against)


_QWEN2_5 = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                vocab_size=151936, attention_dropout=0.0, use_sliding_window=False)

SHAPES: dict[str, Shape] = {
    "qwen2.5-0.5b": Shape("Qwen/Qwen2.5-0.5B", "Qwen2Config", "Qwen2ForCausalLM", dict(
        _QWEN2_5, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768), parameters=494_032_768),
    "qwen2.5-1.5b": Shape("Qwen/Qwen2.5-1.5B", "Qwen2Config", "Qwen2ForCausalLM", dict(
        _QWEN2_5, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=131072), parameters=1_543_714_304),
    "llama-3.2-1b": Shape("meta-llama/Llama-3.2-1B", "LlamaConfig", "LlamaForCausalLM", dict(
        hidden_act="silu", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, high_freq_factor=4.0,
                             low_freq_factor=1.0, original_max_position_embeddings=8192)),
        parameters=1_235_814_400),
    "gemma-3-1b": Shape("google/gemma-3-1b-pt", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(26)],
        tie_word_embeddings=True, final_logit_softcapping=None, attn_logit_softcapping=None),
        parameters=999_885_952),
}
"""Name -> shape. Values from each checkpoint's published config.json (rope and attention settings included)."""


def shape_name(model: str) -> str | None:
    """The shape `model` names (`shape:qwen2.5-1.5b` -> `qwen2.5-1.5b`), or None when it names no shape."""
    if not model.startswith(PREFIX):
        return None
    name = model[len(PREFIX):].lower()
    if name not in SHAPES:
        raise ConfigError("model_name_or_path", f"{model!r} names no known shape",
                          f"use one of {', '.join(PREFIX + n for n in SHAPES)}, or a model directory / hub id")
    return name


def shape_config(name: str, **overrides: Any):
    """The transformers config of shape `name` (with `overrides`, e.g. fewer layers for a test), ids the toy's."""
    # heavy: transformers' config classes (the toy tokenizer's module imports transformers too)
    import transformers

    from asyncgrpo.toy.tokenizer import EOS_ID

    values = {**SHAPES[name].values, **overrides}
    if "num_hidden_layers" in overrides and "layer_types" in values:
        values["layer_types"] = values["layer_types"][:values["num_hidden_layers"]]
        values["layer_types"][-1] = "full_attention"  # a Gemma stack ends on a full-attention layer
    config = getattr(transformers, SHAPES[name].config_class)(**values)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = EOS_ID
    return config


def build_shape_tokenizer(vocab_size: int):
    """The toy byte-level tokenizer padded with filler tokens so that `len(tokenizer) == vocab_size`."""
    # heavy: tokenizers and transformers (the toy tokenizer's module), only when a shape is built
    from tokenizers import Tokenizer

    from asyncgrpo.toy.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(tokenizer), vocab_size):
        vocab[f"<|filler_{i}|>"] = i  # never produced by encoding (no merges reach it); decodes to its own text
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(spec))
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


def build_shape_model(name: str, directory: str | Path, dtype: str = "bfloat16", seed: int = 0,
                      **overrides: Any) -> Path:
    """Save shape `name` with random (seeded) weights in `dtype` and its tokenizer in `directory`; return it."""
    # heavy: torch and transformers, only when a shape is built
    import torch
    import transformers
    from transformers import GenerationConfig

    from asyncgrpo.toy.tokenizer import EOS_ID

    config = shape_config(name, **overrides)
    torch.manual_seed(seed)
    model_class = getattr(transformers, SHAPES[name].model_class)
    with torch.device("cpu"):
        model = model_class._from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    directory = Path(directory)
    model.save_pretrained(directory)
    build_shape_tokenizer(config.vocab_size).save_pretrained(directory)
    return directory


def shape_model_dir(model: str, dtype: str = "bfloat16", cache_dir: str | Path | None = None,
                    log=print) -> str:
    """The cached directory of `shape:<name>` in `dtype`, built on first use (one builder; others wait)."""
    from asyncgrpo.toy.world import build_cached, default_cache_dir  # heavy: the toy world's module imports torch

    name = shape_name(model)
    assert name is not None, model
    if dtype not in DTYPES:
        raise ConfigError("torch_dtype", f"a shape is built in {dtype!r}", f"use one of {', '.join(DTYPES)}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = (cache / f"shape-{name}-{dtype}").resolve()
    if not (root / COMPLETE).is_file():
        log(f"building {model} ({SHAPES[name].parameters / 1e9:.2f}B parameters, random weights, {dtype}) "
            f"into {root}: once, then cached")
        build_cached(root, lambda staging: build_shape_model(name, staging, dtype), log, marker=COMPLETE)
    return str(root)
