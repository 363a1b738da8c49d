"""Tiny random models of the architectures users train, built locally from transformers' own config classes, with
the toy tokenizer: what the architecture tests train a LoRA step on and serve with vLLM (docs/models.md).

Shapes are the smallest vLLM's CPU build serves: attention head_dim 32 (it accepts 32, 64, 80, 96, 112, 128; 16
starts and then kills the engine on the first request), 2 layers, hidden 128, vocabulary 320 (the toy tokenizer's
259 ids, padded). Weights are random (seeded); the tests compare logprobs, not answers.

    python -m asyncgrpo.toy.architectures gemma3 /tmp/tiny-gemma3    # build one and print its directory
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.tokenizer import EOS_ID, build_tokenizer

VOCAB = 320
HEAD_DIM = 32
SLIDING_WINDOW = 64  # longer than any toy sequence (~10 tokens): the sliding layers see everything, as in HF
# Shared by every architecture: the toy's shapes, ids of the toy tokenizer, one full and (where the architecture has
# them) one sliding-window layer.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=EOS_ID,
    eos_token_id=EOS_ID, pad_token_id=EOS_ID,
)
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]  # Gemma's last layer must be full attention


def _qwen2():
    # heavy: transformers' modeling code (and torch): each builder loads only its own architecture's
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**COMMON))  # head_dim = hidden / heads = 32


def _qwen3():
    # heavy: transformers' modeling code (and torch): each builder loads only its own architecture's
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=HEAD_DIM))


def _llama():
    # heavy: transformers' modeling code (and torch): each builder loads only its own architecture's
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**COMMON, head_dim=HEAD_DIM))


def _gemma3():
    # heavy: transformers' modeling code (and torch): each builder loads only its own architecture's
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                              sliding_window=SLIDING_WINDOW, layer_types=SLIDING_THEN_FULL))


def _gemma4_text_config():
    # heavy: transformers' modeling code (and torch): each builder loads only its own architecture's
    from transformers import Gemma4TextConfig

    # Full-attention layers use their own head size (global_head_dim, 512 in real checkpoints: too big for the
    # CPU build's kernels); per-layer input embeddings (PLE) sized to the toy vocabulary.
    return Gemma4TextConfig(**COMMON, head_dim=HEAD_DIM, global_head_dim=2 * HEAD_DIM, sliding_window=SLIDING_WINDOW,
                            layer_types=SLIDING_THEN_FULL, vocab_size_per_layer_input=VOCAB,
                            hidden_size_per_layer_input=16)


def _gemma4():
    # heavy: transformers' modeling code (and torch): each builder loads only its own architecture's
    from transformers import Gemma4ForCausalLM

    return Gemma4ForCausalLM(_gemma4_text_config())


def _gemma4_wrapper():
    # heavy: transformers' modeling code (and torch): each builder loads only its own architecture's
    from transformers import (
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4VisionConfig,
    )

    # What real Gemma 4 checkpoints are: the decoder under model.language_model (transformers; vLLM's multimodal
    # wrapper calls it language_model.model), beside a vision tower whose attention and MLP modules have the same
    # names as the decoder's (q_proj, ..., as Gemma4ClippableLinear). One tiny vision layer stands for it.
    vision = Gemma4VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=HEAD_DIM, position_embedding_size=64)
    return Gemma4ForConditionalGeneration(Gemma4Config(text_config=_gemma4_text_config(), vision_config=vision,
                                                       audio_config=None, tie_word_embeddings=True))


ARCHITECTURES: dict[str, Callable[[], Any]] = {
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "llama": _llama,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "gemma4-wrapper": _gemma4_wrapper,
}
"""Name -> a function returning a freshly initialised fp32 model of that architecture."""


def build_tiny_model(architecture: str, directory: str | Path, seed: int = 0) -> Path:
    """Save a random `architecture` model (fp32 safetensors) and the toy tokenizer in `directory`; return it."""
    # heavy: torch, only when a model is built (the builders' table imports without it)
    import torch
    from transformers import GenerationConfig

    if architecture not in ARCHITECTURES:
        raise ConfigError("architecture", f"unknown {architecture!r}", f"use one of {', '.join(ARCHITECTURES)}")
    torch.manual_seed(seed)
    model = ARCHITECTURES[architecture]().to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    directory = Path(directory)
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("architecture", choices=sorted(ARCHITECTURES))
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_model(args.architecture, args.directory, args.seed))


if __name__ == "__main__":
    main()
