"""The accelerate state for every launcher on CPU and GPU, and small named collectives the trainer calls."""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist


def make_accelerator(ddp_timeout_s: int):
    """Build the Accelerator. On CPU hosts accelerate needs help (measured in shared/NOTES.md):
    gloo with an explicit timeout (a rank that skips a collective must not hang for 30 minutes), and an
    explicit backend for DeepSpeed, or every rank believes it is rank 0."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    timeout = datetime.timedelta(seconds=ddp_timeout_s)
    on_cpu = not torch.cuda.is_available()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") == "true":
        backend = "gloo" if on_cpu else None
        return Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=timeout)])
    if on_cpu:
        state = PartialState(cpu=True, timeout=timeout)
        if os.environ.get("ACCELERATE_USE_FSDP") == "true":
            state.distributed_type = DistributedType.MULTI_GPU  # else the FSDP plugin is ignored on CPU
        return Accelerator(cpu=True)
    return Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(obj, src: int = 0):
    """Collective: every rank calls it; returns rank `src`'s object on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def dist_sum(value: float) -> float:
    """Collective: the sum of `value` over all ranks."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def setup_logging(rank: int) -> None:
    """`logging` with the rank in the prefix; rank 0 logs INFO, the others WARNING and above."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
