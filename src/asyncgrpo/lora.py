"""The LoRA configuration and wrapping, in one place for the trainer and for doctor's probe adapter.

`lora_config` targets `lora_target_modules` inside the language model only: a multimodal checkpoint's vision or
audio tower is excluded (docs/trainer-internals.md says why).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from asyncgrpo.config import ModelSettings

# Sub-modules of multimodal checkpoints outside the language model (Gemma 3/4, LLaVA-style, Qwen2-VL).
MULTIMODAL_TOWERS = ("vision_tower", "audio_tower", "embed_vision", "embed_audio", "multi_modal_projector", "visual")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
TOWER_PATTERN = rf"(.*\.)?({'|'.join(MULTIMODAL_TOWERS)})\..*"  # PEFT full-matches a str exclude_modules


def tower_exclusion(module_names: Iterable[str]) -> str | None:
    """The exclude_modules pattern when any module lies inside a multimodal tower, else None (PEFT warns about an
    exclusion that matches nothing)."""
    pattern = re.compile(TOWER_PATTERN)
    return TOWER_PATTERN if any(pattern.fullmatch(name) for name in module_names) else None


def lora_config(settings: ModelSettings, model):
    """PEFT's LoraConfig for `settings` on `model` (a transformers model, possibly on the meta device): rank, alpha,
    dropout and `lora_target_modules`, inside the language model only."""
    from peft import LoraConfig  # heavy: peft (and transformers), only once an adapter is built

    targets = list(settings.lora_target_modules)
    if targets == [ALL_LINEAR]:
        targets = ALL_LINEAR  # PEFT reads the word only as a string; in a list it is a module name that matches nothing
    return LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM", bias="none",
                      exclude_modules=tower_exclusion(name for name, _ in model.named_modules()))


def with_lora(settings: ModelSettings, base) -> tuple[torch.nn.Module, object]:
    """`base` wrapped with the LoRA adapter `settings` ask for (lora_target_modules, in the language model only:
    lora.py); returns (PEFT model, its LoraConfig)."""
    from peft import get_peft_model  # heavy: peft, only once an adapter is built

    peft_config = lora_config(settings, base)
    return get_peft_model(base, peft_config), peft_config
