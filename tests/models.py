"""The tiny PEFT model the trainer tests share: `Tiny` (two projections named like an attention block's) and
`tiny_lora(...)`, LoRA on both with random non-zero A and B, the same on every rank for one seed.

Small enough to build in milliseconds on the CPU, with odd dims by default so that no 2-way dim-0 split is even (the
sharded gathers and checkpoints must handle uneven shards). Importable as `from models import tiny_lora`.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model


class Tiny(torch.nn.Module):
    """q_proj (d -> h) then v_proj (h -> d)."""

    def __init__(self, d: int = 5, h: int = 9):
        super().__init__()
        self.q_proj = torch.nn.Linear(d, h)
        self.v_proj = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.v_proj(self.q_proj(x))


def tiny_lora(d: int = 5, h: int = 9, *, r: int = 3, seed: int = 0, lora_seed: int | None = None,
              dtype: torch.dtype = torch.float32):
    """`Tiny(d, h)` with LoRA rank `r` (alpha 2r) on q and v: A is (r, d) / (r, h), B (h, r) / (d, r). Base and LoRA
    weights drawn after torch.manual_seed(seed) (PEFT's init_lora_weights=False: A and B both non-zero); `lora_seed`:
    A and B redrawn from it, the base kept (two models that differ in their adapter only). `dtype`: the whole model's
    (a bf16 base trains bf16 LoRA weights)."""
    torch.manual_seed(seed)
    model = get_peft_model(Tiny(d, h), LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    if lora_seed is not None:
        torch.manual_seed(lora_seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param))
    return model.to(dtype)


def lora_qv(model):
    """`model` with a rank-4 LoRA on q_proj and v_proj, initialised away from zero, in train mode."""
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).train()


def two_padded_sequences(vocab: int = 300) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, mask) of two sequences of different lengths (right padding), their completion
    positions starting at different offsets: prompt 5 + 7 completion tokens, and prompt 3 + 6 then padding."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab, (2, 12), generator=g)
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, 9:] = 0
    mask = torch.zeros(2, 11)
    mask[0, 4:11] = 1.0
    mask[1, 2:8] = 1.0
    return input_ids, attention, mask
