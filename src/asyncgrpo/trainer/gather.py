"""Gather only the LoRA tensors to rank 0, under PEFT's saved key names: one function per backend.

Every function here is a collective: every rank calls it, rank 0 gets {peft key: CPU tensor}, the others None. The
base weights never move. docs/trainer-internals.md describes each backend's layout and how its gather cuts it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from asyncgrpo.distributed import to_collective, to_host
from asyncgrpo.errors import AsyncGRPOError


def backend_of(accelerator) -> str:
    """Name of the sharding backend the accelerator runs: ddp (also single process), fsdp1, fsdp2, zero2, zero3."""
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


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def gather_ddp(accelerator, model) -> tuple[dict[str, torch.Tensor] | None, int]:
    """Collective (trivially): DDP replicates parameters, so rank 0 copies its own."""
    if not accelerator.is_main_process:
        return None, 0
    peft_model = accelerator.unwrap_model(model)
    state = {n: p.detach().to("cpu", copy=True) for n, p in lora_parameters(peft_model)}
    return _to_peft_keys(peft_model, state), _nbytes(state.values())


def gather_zero2(accelerator, model) -> tuple[dict[str, torch.Tensor] | None, int]:
    """Collective (trivially): ZeRO-1/2 shard optimizer state and gradients, not parameters."""
    return gather_ddp(accelerator, model)


def gather_zero3(accelerator, model) -> tuple[dict[str, torch.Tensor] | None, int]:
    """Collective: ZeRO-3 partitions every parameter: rank r holds elements [r*k, (r+1)*k) of the flattened (padded)
    parameter in `ds_tensor`. Concatenate this rank's LoRA partitions and gather them to rank 0 in one call (ZeRO's
    own GatheredParameters all-gathers parameter by parameter, to every rank); rank 0 cuts out each tensor. The base
    stays sharded."""
    peft_model = accelerator.unwrap_model(model)
    named = lora_parameters(peft_model)
    if not all(hasattr(p, "ds_tensor") for _, p in named):  # not partitioned (e.g. one rank): a local copy
        return gather_ddp(accelerator, model)
    parts = [p.ds_tensor.detach().reshape(-1) for _, p in named]  # equal sizes on every rank
    local = to_collective(torch.cat(parts))
    buffers = [torch.empty_like(local) for _ in range(accelerator.num_processes)] if accelerator.is_main_process else None
    dist.gather(local, buffers, dst=0)
    if not accelerator.is_main_process:
        return None, 0
    buffers = [to_host(buf) for buf in buffers]
    per_rank = [torch.split(buf, [t.numel() for t in parts]) for buf in buffers]
    state = {}
    for i, (name, param) in enumerate(named):
        flat = torch.cat([chunks[i] for chunks in per_rank])[:param.ds_numel]
        state[name] = flat.view(param.ds_shape).clone()
    return _to_peft_keys(peft_model, state), len(buffers) * local.numel() * local.element_size()


def gather_fsdp2(accelerator, model) -> tuple[dict[str, torch.Tensor] | None, int]:
    """Collective: FSDP2 keeps each parameter as a DTensor sharded on dim 0 over the ranks. Each rank concatenates
    its LoRA shards into one flat buffer and sends it to rank 0 (a call per parameter would pay the collective's
    latency hundreds of times on a real model); rank 0 cuts them back into full tensors. The buffers differ in
    size (a rank-1 adapter's lora_A has one row, held by one rank), so they travel point to point at their own
    sizes: padding them to one size for `gather` moved up to 1.44x the adapter's bytes. The base never moves."""
    peft_model = accelerator.unwrap_model(model)
    named = lora_parameters(peft_model)
    if not all(_is_dim0_sharded(p) for _, p in named):  # another layout: let DTensor gather each one
        return _gather_full_tensors(accelerator, peft_model, named)
    shards = [p.to_local().detach().reshape(-1) for _, p in named]
    dtype = named[0][1].dtype
    assert all(t.dtype == dtype for t in shards), "LoRA parameters of mixed dtypes"
    local = to_collective(torch.cat(shards) if shards else torch.zeros(0, dtype=dtype))
    counts = to_collective(torch.tensor([t.numel() for t in shards], dtype=torch.int64))
    sizes = [torch.zeros_like(counts) for _ in range(accelerator.num_processes)]
    dist.all_gather(sizes, counts)  # every rank learns every rank's shard sizes: who sends how much
    sizes = [to_host(s) for s in sizes]
    totals = [int(s.sum()) for s in sizes]
    rank = accelerator.process_index
    if rank != 0:
        if totals[rank]:
            dist.send(local, dst=0)
        return None, 0
    buffers = [local] + [to_collective(torch.empty(totals[r], dtype=dtype)) for r in range(1, len(sizes))]
    for request in [dist.irecv(buffers[r], src=r) for r in range(1, len(sizes)) if totals[r]]:
        request.wait()
    buffers = [to_host(buf) for buf in buffers]
    # Rank r's buffer holds, parameter after parameter, its rows of each one; the rows of ranks 0..W-1 in order
    # are the whole tensor (dim-0 sharding).
    pieces = [torch.split(buf, n.tolist()) for buf, n in zip(buffers, sizes)]
    state = {}
    for i, (name, param) in enumerate(named):
        rows = [piece[i].view(-1, *param.shape[1:]) for piece in pieces]
        state[name] = torch.cat(rows).to("cpu", copy=True)
        assert state[name].shape == param.shape, f"{name}: gathered {tuple(state[name].shape)}, want {tuple(param.shape)}"
    return _to_peft_keys(peft_model, state), sum(totals) * local.element_size()


def _is_dim0_sharded(param) -> bool:
    from torch.distributed.tensor import DTensor, Shard  # heavy: torch.distributed.tensor (~1 s), FSDP2 only

    return isinstance(param, DTensor) and tuple(param.placements) == (Shard(0),)


def _gather_full_tensors(accelerator, peft_model, named) -> tuple[dict[str, torch.Tensor] | None, int]:
    """Collective: one all-gather per parameter (DTensor.full_tensor); for layouts other than dim-0 sharding."""
    state = {}
    for name, param in named:
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # every rank joins each gather
        if accelerator.is_main_process:
            state[name] = full.detach().to("cpu", copy=True)
    if not accelerator.is_main_process:
        return None, 0
    return _to_peft_keys(peft_model, state), _nbytes(state.values())


def _fsdp1_local_slices(model, rank: int) -> list[tuple[str, tuple[int, ...], int, torch.Tensor]]:
    """This rank's part of every LoRA parameter of an FSDP1 model: (name, full shape, start offset in the
    flattened parameter, the slice). FSDP1 splits each unit's flat buffer evenly over ranks, so a parameter may lie
    on one rank, or across two, or partly in padding; `_shard_param_infos` says which elements this rank holds."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # heavy: torch's FSDP, FSDP1 only

    names = {id(p): n for n, p in model.named_parameters()}
    slices = []
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        assert flat._params is not None, "FSDP1 needs use_orig_params=True (see launch/accelerate/fsdp1.yaml)"
        if not handle.uses_sharded_strategy and rank != 0:
            continue  # NO_SHARD: every rank holds everything; rank 0's copy is enough
        local_shard = getattr(flat, "_local_shard", None)  # set at FSDP's lazy init (the first forward)
        assert local_shard is None or not handle.uses_sharded_strategy or flat.data_ptr() == local_shard.data_ptr(), \
            "FSDP1 flat parameter is not resharded at sync time"
        for param, shape, info in zip(flat._params, flat._shapes, flat._shard_param_infos):
            name = names.get(id(param), "")
            if not (param.requires_grad and "lora_" in name) or not info.in_shard:
                continue
            local = flat.detach()[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
            slices.append((clean_fsdp_name(name), tuple(shape), info.intra_param_start_idx, local.to("cpu", copy=True)))
    return slices


def _fsdp1_slices_on_rank0(accelerator, mine: list) -> list | None:
    """Collective: every rank's slices on rank 0 (None elsewhere). Where each slice goes (name, shape, offset, size)
    travels as a small object; the values travel as one flat buffer per rank, point to point: pickling hundreds of
    tensors for `gather_object` cost 0.8 s for a 74 MB adapter (Qwen2.5-1.5B's shape, r=16) on 2 CPU ranks."""
    places = [(name, shape, start, piece.numel()) for name, shape, start, piece in mine]
    dtype = mine[0][3].dtype if mine else torch.float32
    assert all(piece.dtype == dtype for *_, piece in mine), "LoRA parameters of mixed dtypes"
    local = torch.cat([piece.reshape(-1) for *_, piece in mine]) if mine else torch.zeros(0, dtype=dtype)
    received = [None] * accelerator.num_processes if accelerator.is_main_process else None
    dist.gather_object((places, str(dtype).removeprefix("torch.")), received, dst=0)
    if not accelerator.is_main_process:
        if local.numel():
            dist.send(to_collective(local), dst=0)
        return None
    buffers = [to_collective(local)] + [to_collective(torch.empty(sum(p[3] for p in rank_places),
                                                                  dtype=getattr(torch, rank_dtype)))
                                        for rank_places, rank_dtype in received[1:]]
    for request in [dist.irecv(buf, src=r) for r, buf in enumerate(buffers) if r and buf.numel()]:
        request.wait()
    slices = []
    for (rank_places, _), buf in zip(received, buffers):
        pieces = torch.split(to_host(buf), [p[3] for p in rank_places])
        slices += [(name, shape, start, piece) for (name, shape, start, _), piece in zip(rank_places, pieces)]
    return slices


def clean_fsdp_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def gather_fsdp1(accelerator, model) -> tuple[dict[str, torch.Tensor] | None, int]:
    """Collective: FSDP1 (use_orig_params) keeps each rank's slice of every unit's flat buffer. Each rank sends rank 0
    only the slices of LoRA parameters it holds, with their offsets; rank 0 reassembles the full tensors. The base
    weights never move (summon_full_params would gather whole units, base included). The result is checked against
    the adapter's parameters (names, shapes, every element covered once), because PEFT's own save silently writes
    zero tensors for FSDP1 models (docs/cpu-hosts.md#gathering-only-the-adapter)."""
    mine = _fsdp1_local_slices(model, accelerator.process_index)
    slices = _fsdp1_slices_on_rank0(accelerator, mine)
    if slices is None:
        return None, 0
    peft_model = accelerator.unwrap_model(model)
    expected = {clean_fsdp_name(n): p for n, p in lora_parameters(peft_model)}
    flat, covered, shapes, nbytes = {}, {}, {}, 0
    for name, shape, start, piece in slices:
        numel = math.prod(shape)
        flat.setdefault(name, torch.zeros(numel, dtype=piece.dtype))[start:start + piece.numel()] = piece
        covered[name] = covered.get(name, 0) + piece.numel()
        shapes[name] = shape
        nbytes += piece.numel() * piece.element_size()
    assert set(flat) == set(expected), f"FSDP1 gather names differ from the adapter's: {sorted(set(flat) ^ set(expected))[:3]}"
    short = [n for n, shape in shapes.items() if covered[n] != math.prod(shape)]
    assert not short, f"FSDP1 gather did not cover every element of {short[:3]}"
    state = {n: flat[n].view(shapes[n]) for n in flat}
    return _to_peft_keys(peft_model, state), nbytes


_GATHERERS = {"ddp": gather_ddp, "zero1": gather_zero2, "zero2": gather_zero2, "zero3": gather_zero3,
              "fsdp1": gather_fsdp1, "fsdp2": gather_fsdp2}


def gather_lora_state(accelerator, model, stats: dict | None = None) -> dict[str, torch.Tensor] | None:
    """Collective: every rank calls it. Returns the LoRA tensors on rank 0 (CPU, PEFT key names), None elsewhere.
    If `stats` is given, rank 0 records in it `gathered_bytes`: the bytes the gather brought to rank 0 (the adapter's
    own bytes on every backend; a whole-model gather would show here)."""
    backend = backend_of(accelerator)
    gather = _GATHERERS.get(backend)
    if gather is None:
        raise AsyncGRPOError(f"the {backend} backend is not supported; launch with one of the configs in "
                             f"launch/accelerate/ (DDP, FSDP1, FSDP2, ZeRO-2, ZeRO-3)")
    tensors, gathered_bytes = gather(accelerator, model)
    if stats is not None:
        stats["gathered_bytes"] = gathered_bytes
    return tensors
