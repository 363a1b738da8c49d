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
    """Parameter names -> the keys PEFT saves: `...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`.
    (PEFT's get_peft_model_state_dict returns nothing for the names of an FSDP1-wrapped model.)"""
    marker = f".{peft_model.active_adapter}."
    return {name.replace(marker, ".", 1): tensor for name, tensor in state.items()}


def gather_ddp(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Collective (trivially): DDP replicates parameters, so rank 0 copies its own."""
    if not accelerator.is_main_process:
        return None
    peft_model = accelerator.unwrap_model(model)
    state = {n: p.detach().to("cpu", copy=True) for n, p in lora_parameters(peft_model)}
    return _to_peft_keys(peft_model, state)


def gather_zero2(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Collective (trivially): ZeRO-1/2 shard optimizer state and gradients, not parameters."""
    return gather_ddp(accelerator, model)


def gather_zero3(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Collective: ZeRO-3 partitions every parameter; gather the LoRA ones only (the base stays sharded)."""
    import deepspeed

    peft_model = accelerator.unwrap_model(model)
    named = lora_parameters(peft_model)
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        if not accelerator.is_main_process:
            return None
        state = {n: p.detach().to("cpu", copy=True) for n, p in named}
    return _to_peft_keys(peft_model, state)


def gather_fsdp2(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Collective: FSDP2 keeps each parameter as a DTensor shard; all-gather the LoRA DTensors only."""
    peft_model = accelerator.unwrap_model(model)
    state = {}
    for name, param in lora_parameters(peft_model):
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # every rank joins each gather
        if accelerator.is_main_process:
            state[name] = full.detach().to("cpu", copy=True)
    return _to_peft_keys(peft_model, state) if accelerator.is_main_process else None


def gather_fsdp1(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Collective: FSDP1 (use_orig_params) flattens parameters into per-unit buffers; summon them (no CPU offload:
    it segfaults on CPU hosts) and copy the LoRA views. Names lose FSDP's wrapper prefixes, and the result is checked
    against the adapter's parameters, because PEFT's own save silently writes zero tensors here (shared/NOTES.md)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    state = {}
    with FSDP.summon_full_params(model, writeback=False, rank0_only=False, offload_to_cpu=False):
        if accelerator.is_main_process:
            for name, param in model.named_parameters():
                if param.requires_grad and "lora_" in name:
                    clean = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
                    state[clean] = param.detach().to("cpu", copy=True)
    if not accelerator.is_main_process:
        return None
    peft_model = accelerator.unwrap_model(model)
    expected = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in lora_parameters(peft_model)}
    assert set(state) == set(expected), f"FSDP1 gather names differ from the adapter's: {sorted(state)[:3]}"
    empty = [n for n, t in state.items() if t.numel() == 0]
    assert not empty, f"FSDP1 gather returned empty tensors for {empty[:3]}"
    return _to_peft_keys(peft_model, state)


_GATHERERS = {"ddp": gather_ddp, "zero1": gather_zero2, "zero2": gather_zero2, "zero3": gather_zero3,
              "fsdp1": gather_fsdp1, "fsdp2": gather_fsdp2}


def gather_lora_state(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Collective: every rank calls it. Returns the LoRA tensors on rank 0 (CPU, PEFT key names), None elsewhere."""
    backend = backend_of(accelerator)
    gather = _GATHERERS.get(backend)
    if gather is None:
        raise AsyncGRPOError(f"the {backend} backend is not supported; launch with one of the configs in "
                             f"launch/accelerate/ (DDP, FSDP1, FSDP2, ZeRO-2, ZeRO-3)")
    return gather(accelerator, model)
