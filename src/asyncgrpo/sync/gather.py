"""Gather only the LoRA tensors to rank 0, under PEFT's saved key names. One function per backend.

Every function here is a collective: every rank calls it, rank 0 gets {peft key: CPU tensor}, the others None.
"""

from __future__ import annotations

import torch

from ..errors import AsyncGRPOError


def backend_of(accelerator) -> str:
    """Name of the sharding backend the accelerator runs: ddp (also single process), fsdp1, fsdp2, zero2, zero3."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return "fsdp2" if getattr(accelerator, "is_fsdp2", False) else "fsdp1"
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    return "ddp"


def lora_parameters(peft_model) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's trainable parameters, in a fixed order."""
    return [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" in n]


def _to_peft_keys(peft_model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, state_dict=state)


def gather_ddp(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Collective (trivially): DDP replicates parameters, so rank 0 copies its own."""
    if not accelerator.is_main_process:
        return None
    peft_model = accelerator.unwrap_model(model)
    state = {n: p.detach().to("cpu", copy=True) for n, p in lora_parameters(peft_model)}
    return _to_peft_keys(peft_model, state)


_GATHERERS = {"ddp": gather_ddp}


def gather_lora_state(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Collective: every rank calls it. Returns the LoRA tensors on rank 0 (CPU, PEFT key names), None elsewhere."""
    backend = backend_of(accelerator)
    gather = _GATHERERS.get(backend)
    if gather is None:
        raise AsyncGRPOError(f"the {backend} backend is not supported yet; launch with a DDP config "
                             f"(launch/accelerate/ddp_cpu.yaml or a multi-GPU DDP config)")
    return gather(accelerator, model)
