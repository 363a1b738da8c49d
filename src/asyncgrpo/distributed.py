"""The accelerate state for every launcher on CPU and GPU, and small named collectives the trainer calls."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os

import torch
import torch.distributed as dist


def make_accelerator(ddp_timeout_s: int, deepspeed_config: str | None = None):
    """Build the Accelerator for whichever launcher started us. On CPU hosts accelerate needs help (measured in
    shared/NOTES.md): gloo with an explicit timeout (a rank that skips a collective must not hang for 30 minutes),
    and an explicit backend for DeepSpeed, or every rank believes it is rank 0.

    `deepspeed_config` (config key `deepspeed`) is for the `deepspeed` launcher and `torchrun`, which set only the
    rank variables: the DeepSpeed plugin is then built here. Under `accelerate launch` with a DeepSpeed config file,
    accelerate's own settings win."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, DistributedType, InitProcessGroupKwargs

    timeout = datetime.timedelta(seconds=ddp_timeout_s)
    on_cpu = not torch.cuda.is_available()
    by_accelerate = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true"
    if by_accelerate and deepspeed_config:
        logging.getLogger(__name__).warning("`deepspeed: %s` is ignored: accelerate launch configured DeepSpeed",
                                            deepspeed_config)
    if by_accelerate or deepspeed_config:
        backend = "gloo" if on_cpu else None
        plugin = None if by_accelerate else DeepSpeedPlugin(hf_ds_config=deepspeed_config)
        return Accelerator(deepspeed_plugin=plugin,
                           kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=timeout)])
    if on_cpu:
        state = PartialState(cpu=True, timeout=timeout)
        if os.environ.get("ACCELERATE_USE_FSDP") == "true":
            state.distributed_type = DistributedType.MULTI_GPU  # else the FSDP plugin is ignored on CPU
        return Accelerator(cpu=True)
    return Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])


def wrap_lora_separately(accelerator, peft_model) -> None:
    """FSDP1 flattens each wrapped unit into one buffer of one dtype, so a bf16 base cannot share a unit with fp32
    LoRA weights ("Must flatten tensors with uniform dtype"). Wrap every LoRA layer as its own unit (PEFT's policy:
    decoder layers, plus each leaf module with a trainable weight); a no-op on every other backend."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 1 or accelerator.distributed_type.value != "FSDP":
        return
    from peft.utils.other import fsdp_auto_wrap_policy

    plugin.auto_wrap_policy = fsdp_auto_wrap_policy(peft_model)


@contextlib.contextmanager
def without_zero3_init():
    """Once a ZeRO-3 run has configured DeepSpeed, transformers builds every model under `deepspeed.zero.Init`: a
    collective (rank 0 building something alone hangs), which also casts the weights to the DeepSpeed config's
    dtype (fp32 unless its `bf16` is on). Inside this block models are built plainly."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


@contextlib.contextmanager
def zero3_init_in(dtype: torch.dtype):
    """Collective under ZeRO-3 (every rank builds the model): models built inside are partitioned as they are
    built (`deepspeed.zero.Init`, as transformers does under ZeRO-3), so no rank ever holds the whole base, and they
    keep `dtype`. zero.Init casts every weight to the DeepSpeed config's dtype (fp32 unless its `bf16`/`fp16` is on,
    and those follow accelerate's `mixed_precision`), so transformers sees, for this block only, a copy of the config
    whose `bf16`/`fp16` flags match `dtype`; the engine keeps its own config. A no-op without ZeRO-3."""
    import copy

    from transformers.integrations import deepspeed as hf_deepspeed

    if not hf_deepspeed.is_deepspeed_zero3_enabled():
        yield
        return
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    config = copy.deepcopy(hf_deepspeed.deepspeed_config())
    config["bf16"] = {**config.get("bf16", {}), "enabled": dtype == torch.bfloat16}
    config["fp16"] = {**config.get("fp16", {}), "enabled": dtype == torch.float16}
    keep_alive = hf_deepspeed.HfDeepSpeedConfig(config)  # sets transformers' weak reference to itself
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
        del keep_alive


def recompute_rotary_buffers(model) -> int:
    """zero.Init also casts the tensors a module computes in `__init__` (rotary `inv_freq`, which transformers keeps in
    fp32) to its dtype, and bf16 angles drift by ~1 rad at position 1k (shared/NOTES.md). Rebuild each rotary module
    (they take the model config and hold no weights) outside zero.Init and take its fp32 buffers. Returns how many
    modules were rebuilt."""
    rebuilt = 0
    for module in model.modules():
        stale = {n: b for n, b in module.named_buffers(recurse=False)
                 if b is not None and b.is_floating_point() and b.dtype != torch.float32}
        if not stale or not type(module).__name__.endswith("RotaryEmbedding") or hasattr(module, "weight"):
            continue
        with without_zero3_init():
            fresh = type(module)(module.config)
        for name, old in stale.items():
            module._buffers[name] = getattr(fresh, name).to(old.device)
        rebuilt += 1
    return rebuilt


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(obj, src: int = 0):
    """Collective: every rank calls it; returns rank `src`'s object on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _all_reduce(value: float, op) -> float:
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def dist_sum(value: float) -> float:
    """Collective: the sum of `value` over all ranks."""
    return _all_reduce(value, dist.ReduceOp.SUM)


def dist_max(value: float) -> float:
    """Collective: the maximum of `value` over all ranks."""
    return _all_reduce(value, dist.ReduceOp.MAX)


def setup_logging(rank: int) -> None:
    """`logging` with the rank in the prefix; rank 0 logs INFO, the others WARNING and above."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
