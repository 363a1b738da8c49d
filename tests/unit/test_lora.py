"""LoRA targets the language model only: a multimodal checkpoint's towers, whose modules share the decoder's names,
are excluded (PEFT cannot wrap Gemma 4's vision Gemma4ClippableLinear at all), and a text-only model gets no
exclusion (PEFT would warn that it matched nothing)."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.lora import TOWER_PATTERN, lora_config, tower_exclusion
from asyncgrpo.toy.architectures import ARCHITECTURES


def test_tower_exclusion_only_when_a_tower_exists():
    assert tower_exclusion(["model.layers.0.self_attn.q_proj", "lm_head"]) is None
    assert tower_exclusion(["model.vision_tower.encoder.layers.0.self_attn.q_proj"]) == TOWER_PATTERN
    assert tower_exclusion(["model.visual.blocks.0.attn.qkv"]) == TOWER_PATTERN  # Qwen2-VL
    assert tower_exclusion(["model.layers.0.mlp.visualizer_proj"]) is None  # a name merely starting alike


@pytest.mark.parametrize("arch", ["gemma4-wrapper", "qwen3"])
def test_the_adapter_covers_every_decoder_target_and_nothing_in_the_vision_tower(arch):
    from peft import get_peft_model


    cfg = AsyncGRPOConfig(model_name_or_path="toy", use_lora=True, lora_adapter_path="/tmp/adapters")
    with torch.device("meta"):
        model = ARCHITECTURES[arch]()
    peft_model = get_peft_model(model, lora_config(cfg, model))  # raised ValueError on the wrapper before
    adapted = [n.removesuffix(".lora_A") for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]
    decoder = "model.language_model.layers" if arch == "gemma4-wrapper" else "model.layers"
    assert len(adapted) == 2 * 7 and all(n.startswith(f"base_model.model.{decoder}.") for n in adapted)
    towers = [n for n, _ in model.named_modules() if ".vision_tower." in n]
    assert bool(towers) == (arch == "gemma4-wrapper")  # the wrapper really has q_proj & co. in a vision tower
