"""The accelerate state for every launcher on CPU and GPU, and small named collectives the trainer calls."""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import socket
import sys
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType, InitProcessGroupKwargs

from asyncgrpo.errors import AsyncGRPOError, PeerFailed


def cpu_requested() -> bool:
    """True when this process was explicitly asked to run on CPU: `ACCELERATE_USE_CPU` (accelerate's `--cpu`, the
    `*_cpu.yaml` configs' environment) or `DS_ACCELERATOR=cpu` (DeepSpeed on CPU)."""
    return (os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
            or os.environ.get("DS_ACCELERATOR", "").lower() == "cpu")


def launched_world_size() -> int:
    """The number of ranks the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def leave_launched_process(code: int) -> None:
    """End a rank of a multi-process launch once its work is done and its process group destroyed: flush the logs
    and the standard streams, then `os._exit(code)`, skipping interpreter finalization. There, on 2-rank gloo
    launches (FSDP2, ZeRO-2), a rank was seen to abort ~1 in 30 runs with "terminate called without an active
    exception" after the run had finished and saved everything: the launcher then reports the job failed (exit -6)
    and stops the other ranks. Everything this project starts (reward workers, the rollout process, TensorBoard) is
    closed explicitly before this point; nothing is left for atexit. A single process returns normally."""
    if launched_world_size() <= 1:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)


def require_usable_device() -> bool:
    """Returns True to run on CPU. A launch of several ranks on a host where CUDA is not usable stops here, unless
    CPU was asked for explicitly: a GPU launch config must never fall back silently to gloo on CPU (a job on a
    node whose driver or `CUDA_VISIBLE_DEVICES` is wrong would otherwise train for hours at CPU speed)."""
    if torch.cuda.is_available():
        return cpu_requested()
    if cpu_requested() or launched_world_size() == 1:
        return True  # explicit CPU, or one plain process (a laptop run, the in-process tests)
    raise AsyncGRPOError(
        f"this launch started {launched_world_size()} ranks but CUDA is not usable on this host "
        f"(torch {torch.__version__}, torch.cuda.is_available() is False). Fix: run on GPU nodes with a CUDA build of "
        "torch and a working driver (check `nvidia-smi` and CUDA_VISIBLE_DEVICES); for a CPU run say so explicitly: "
        "a launch/accelerate/*_cpu.yaml config with ACCELERATE_USE_CPU=true (DeepSpeed: DS_ACCELERATOR=cpu)")


def make_accelerator(ddp_timeout_s: int, deepspeed_config: str | None = None):
    """Build the Accelerator for whichever launcher started us. On CPU hosts accelerate needs help
    (docs/cpu-hosts.md#backends-with-2-cpu-processes): gloo with an explicit timeout (a rank that skips a collective
    must not hang for ddp_timeout's 60 minutes),
    and an explicit backend for DeepSpeed, or every rank believes it is rank 0. On GPU hosts the process group is
    NCCL, and every tensor a collective here receives is moved to `collective_device()` first.

    `deepspeed_config` (config key `deepspeed`) is for the `deepspeed` launcher and `torchrun`, which set only the
    rank variables: the DeepSpeed plugin is then built here. Under `accelerate launch` with a DeepSpeed config file,
    accelerate's own settings win."""
    timeout = datetime.timedelta(seconds=ddp_timeout_s)
    on_cpu = require_usable_device()
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


def configure_backend(accelerator, peft_model, *, max_grad_norm: float) -> None:
    """Before `prepare()`: what each sharding backend needs so that it trains the LoRA adapter correctly. Every
    backend difference of the training step lives here (and in `accumulation`), not in the loop."""
    _wrap_lora_separately(accelerator, peft_model)
    _fp32_buffers_and_reduction(accelerator)
    _deepspeed_clipping(accelerator, max_grad_norm)


def _fsdp_plugin(accelerator):
    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    return getattr(accelerator.state, "fsdp_plugin", None)


def _wrap_lora_separately(accelerator, peft_model) -> None:
    """FSDP1 flattens each wrapped unit into one buffer of one dtype, so a bf16 base cannot share a unit with fp32
    LoRA weights ("Must flatten tensors with uniform dtype"). Wrap every LoRA layer as its own unit (PEFT's policy:
    decoder layers, plus each leaf module with a trainable weight)."""
    plugin = _fsdp_plugin(accelerator)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 1:
        return
    from peft.utils.other import fsdp_auto_wrap_policy  # heavy: peft, FSDP1 only

    plugin.auto_wrap_policy = fsdp_auto_wrap_policy(peft_model)


def deepspeed_mode_on(accelerator, mode: str) -> bool:
    """Whether the DeepSpeed config turns `mode` (`bf16` / `fp16`) on: `true` in the json, or `auto` that accelerate
    filled from `mixed_precision`."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return False
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    return str(ds.get(mode, {}).get("enabled", False)).lower() == "true"


def _fp32_buffers_and_reduction(accelerator) -> None:
    """accelerate's `mixed_precision: bf16` makes FSDP1 cast every buffer to bf16 (the rotary `inv_freq`: with rope
    theta 1e6 that is ~0.6 rad of angle error at position 512, a policy that drifts from the server's) and reduce
    gradients in bf16 on both FSDP versions. Keep the compute dtype, but reduce in fp32 and keep buffers fp32.
    DeepSpeed's bf16 mode would cast the LoRA weights to bf16 too (their fp32 masters living in the optimizer): it is
    switched off here, the base already built in bf16 for it (policy.py), so the LoRA weights, their gradients and
    Adam's state stay fp32. Its fp16 mode (loss scaling) is refused."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        if deepspeed_mode_on(accelerator, "fp16"):
            raise AsyncGRPOError(
                "DeepSpeed's fp16 mode is on (accelerate `mixed_precision: fp16` or `\"fp16\": {\"enabled\": true}` in "
                "the DeepSpeed json): it trains the LoRA weights in fp16 with loss scaling. Fix: `\"enabled\": "
                "\"auto\"` or false in the json's fp16 block and no fp16 mixed precision; for a 16-bit base set "
                "`torch_dtype: bfloat16` (or float16)")
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        if deepspeed_mode_on(accelerator, "bf16"):
            ds["bf16"] = {**ds["bf16"], "enabled": False}
            logging.getLogger(__name__).info("DeepSpeed's bf16 mode is translated: the base model is held in bf16, "
                                             "the LoRA weights and their optimizer state in fp32")
        return
    plugin = _fsdp_plugin(accelerator)
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is None:
        return
    if getattr(plugin, "fsdp_version", 1) == 1:
        from torch.distributed.fsdp import MixedPrecision  # heavy: torch's FSDP, FSDP only

        plugin.mixed_precision_policy = MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=torch.float32,
                                                       buffer_dtype=torch.float32)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy  # heavy: torch's FSDP, FSDP only

        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=policy.param_dtype,
                                                             reduce_dtype=torch.float32,
                                                             output_dtype=policy.output_dtype)


def _deepspeed_clipping(accelerator, max_grad_norm: float) -> None:
    """DeepSpeed clips inside its engine with the json's `gradient_clipping`, which would silently override
    `max_grad_norm`: the json says "auto" (filled here) or must agree."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    value = ds.get("gradient_clipping", "auto")
    if value not in ("auto", None) and float(value) != float(max_grad_norm):
        raise AsyncGRPOError(
            f"the DeepSpeed json sets gradient_clipping {value} but the config key max_grad_norm is {max_grad_norm}. "
            "Fix: set \"gradient_clipping\": \"auto\" in the json (asyncgrpo fills it from max_grad_norm)")
    ds["gradient_clipping"] = float(max_grad_norm)


def fp32_buffer_check(model) -> None:
    """After `prepare()`: every rotary `inv_freq` buffer is still fp32 (see `_fp32_buffers_and_reduction`)."""
    rounded = [name for name, buf in model.named_buffers() if "inv_freq" in name and buf.dtype != torch.float32]
    assert not rounded, f"a backend cast rotary buffers to 16 bits: {rounded[:3]}"


@contextlib.contextmanager
def accumulation(accelerator, model, accumulate: bool):
    """Within it, a backward either accumulates gradients for a later optimizer step (`accumulate=True`: no
    cross-rank reduction on DDP/FSDP) or ends the step's accumulation. accelerate's `no_sync` is a no-op under
    DeepSpeed, whose engine takes an optimizer step inside `accelerator.backward` whenever accelerate's
    `sync_gradients` is true: both are set, so every backend takes one optimizer step per trainer step."""
    state = accelerator.gradient_state
    state._set_sync_gradients(not accumulate)
    try:
        with accelerator.no_sync(model) if accumulate else contextlib.nullcontext():
            yield
    finally:
        state._set_sync_gradients(True)


@contextlib.contextmanager
def without_zero3_init():
    """Once a ZeRO-3 run has configured DeepSpeed, transformers builds every model under `deepspeed.zero.Init`: a
    collective (rank 0 building something alone hangs), which also casts the weights to the DeepSpeed config's
    dtype (fp32 unless its `bf16` is on). Inside this block models are built plainly."""
    from transformers.integrations import deepspeed as hf_deepspeed  # heavy: transformers, when models are built

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
    from transformers.integrations import deepspeed as hf_deepspeed  # heavy: transformers, when models are built

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
    fp32) to its dtype, and bf16 angles drift by ~1 rad at position 1k (docs/cpu-hosts.md#bf16-rotary-buffers). Rebuild each rotary module
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


# ---- collectives on the process group's device ---------------------------------------------------------------
# NCCL has no CPU backend: a CPU tensor handed to a collective there is a crash ("No backend type associated with
# device type cpu"), not a slowdown. Every tensor our code hands to torch.distributed goes through
# `to_collective` just before the call, and results come back through `to_host` just after.

def collective_device() -> torch.device:
    """The device the default process group's collectives take tensors on: CPU when the group has a CPU backend
    (gloo), else the current accelerator device (NCCL: this rank's GPU)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    config = str(dist.get_backend_config())  # e.g. "cpu:gloo,cuda:gloo" or "cuda:nccl"
    if "cpu:" in config or config in ("gloo", "mpi"):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _transfer(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device)


def to_collective(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the collective device (a no-op when it is there already, e.g. a GPU shard under NCCL)."""
    return _transfer(tensor, collective_device())


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A collective's result on the CPU (a no-op on gloo)."""
    return _transfer(tensor, torch.device("cpu"))


def broadcast_object(obj, src: int = 0):
    """Collective: every rank calls it; returns rank `src`'s object on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def scatter_object(parts: list | None, src: int = 0):
    """Collective: rank `src` passes one object per rank, in rank order (`parts`; what the other ranks pass is
    ignored); every rank returns its own part. Only that part is sent to each rank, where `broadcast_object(parts)`
    would send every rank all of them. Under NCCL the objects travel as tensors on the current CUDA device, which must
    be this rank's GPU (`torch.cuda.set_device`; accelerate sets it), else every rank of a node works on GPU 0.
    Without a process group, or with one rank, returns `parts[0]`."""
    if not is_distributed():
        return parts[0]
    box = [None]
    dist.scatter_object_list(box, parts if dist.get_rank() == src else None, src=src)
    return box[0]


def on_main(fn, what: str):
    """Collective: rank 0 runs `fn()` while the others wait; returns its result on rank 0 (None elsewhere). If it
    raises, rank 0 re-raises and every other rank raises `PeerFailed` with rank 0's message at once, instead of
    waiting in its next collective until `ddp_timeout` (60 minutes by default)."""
    result, failure = None, None
    if not is_distributed() or dist.get_rank() == 0:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others are told
            failure = exc
    message = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise PeerFailed(f"rank 0 failed during {what}: {message}")
    return result


def all_gather_object(obj) -> list:
    """Collective: every rank's `obj`, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, obj)
    return box


def require_shared_dir(path, key: str) -> None:
    """Collective: every rank must see the directory `path` (config key `key`) as rank 0 does. Checkpoints are
    written by every rank (RNG states, DeepSpeed partitions) into one directory that rank 0 renames and every rank
    reads back on resume: on several nodes that is shared storage. Rank 0 leaves a probe file there and every rank
    looks for it; ranks that do not see it are named, on every rank, before any training happens."""
    path = Path(path)

    def leave_probe() -> str:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".asyncgrpo-shared-probe-{uuid.uuid4().hex[:12]}"
        probe.write_text("written by rank 0 to check that every rank sees this directory\n")
        return probe.name

    name = broadcast_object(on_main(leave_probe, f"writing a probe file into {key} ({path})"))
    seen = all_gather_object(((path / name).is_file(), socket.gethostname()))
    if not is_distributed() or dist.get_rank() == 0:
        (path / name).unlink(missing_ok=True)
    blind = [f"rank {rank} on {host}" for rank, (ok, host) in enumerate(seen) if not ok]
    if blind:
        raise AsyncGRPOError(
            f"{key} {str(path)!r} is not shared: {', '.join(blind)} cannot see the file rank 0 wrote there. Every "
            f"rank writes checkpoint files into it and reads them back on resume. Fix: set {key} to a directory on "
            "storage every trainer node mounts at the same path (or run on one node)")


def _all_reduce(values: list[float], op) -> list[float]:
    """One all-reduce of every value at once (float64, elementwise)."""
    if not is_distributed():
        return list(values)
    t = to_collective(torch.tensor(values, dtype=torch.float64))
    dist.all_reduce(t, op=op)
    return to_host(t).tolist()


def dist_sum(value: float) -> float:
    """Collective: the sum of `value` over all ranks."""
    return _all_reduce([value], dist.ReduceOp.SUM)[0]


def dist_max(value: float) -> float:
    """Collective: the maximum of `value` over all ranks."""
    return _all_reduce([value], dist.ReduceOp.MAX)[0]


def dist_sums(values: list[float]) -> list[float]:
    """Collective: the sum over all ranks of each of `values`, in one all-reduce."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def dist_maxima(values: list[float]) -> list[float]:
    """Collective: the maximum over all ranks of each of `values`, in one all-reduce."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def setup_logging(rank: int) -> None:
    """`logging` with the rank in the prefix; rank 0 logs INFO, the others WARNING and above."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)
