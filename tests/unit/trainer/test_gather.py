"""The LoRA gather of each backend on two real gloo ranks, with shards of uneven size on dim 0.

Rank 0 is the test process itself and rank 1 a child forked from it (so it runs the very code under test, mutated or
not, and starts in milliseconds); rank 0's calls are traced in-process by coverage and mutation tools while both ranks
run the real collectives. The test sends a scenario's name to the child and runs the same scenario as rank 0; the
child answers `ok NAME` or its traceback. Every scenario builds the same seeded PEFT model on both ranks, shards it the
way the backend does, gathers, and rank 0 compares the result with the unsharded adapter's state dict.

FSDP1 and FSDP2 shard with the real wrappers (FullyShardedDataParallel, fully_shard). ZeRO-3's partitions are laid
out by hand (`ds_tensor`, `ds_numel`, `ds_shape`, as DeepSpeed sets them): a real ZeRO-3 engine needs DeepSpeed's
JIT-built extension and a launch (tests/integration/test_backends.py runs that one).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from gloo import WORLD, two_ranks
from gloo import rank_accelerator as accelerator
from models import Tiny, tiny_lora

from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.trainer.gather import backend_of, clean_fsdp_name, gather_lora_state, lora_parameters


def peft_model(r: int = 3, dtype: torch.dtype = torch.float32):
    """LoRA r=3 on q (5 -> 9) and v (9 -> 5): A is (3, 5) / (3, 9), B (9, 3) / (5, 3); every dim 0 is odd, so no
    2-way dim-0 split is even. Random non-zero A and B, the same on every rank; `dtype`: the whole model's (a bf16
    base trains bf16 LoRA weights)."""
    return tiny_lora(5, 9, r=r, dtype=dtype)


def expected_state(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.clone() for k, v in get_peft_model_state_dict(peft_model(dtype=dtype)).items()}


def _gather(acc, model):
    stats = {}
    return gather_lora_state(acc, model, stats), stats


# ---- scenarios: each runs on both ranks and returns rank 0's (state, stats) ------------------------------------------
def ddp(rank):
    return _gather(accelerator(rank, "ddp"), peft_model())


def zero2(rank):
    acc = accelerator(rank, "deepspeed", state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    return _gather(acc, peft_model())


def fsdp2(rank, dtype=torch.float32):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = peft_model(dtype=dtype)
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    return _gather(accelerator(rank, "fsdp", is_fsdp2=True), model)


def fsdp2_one_message(rank):
    """The fsdp2 scenario, counting the per-parameter DTensor gathers it makes (the fallback for other layouts): rank 0
    returns the count in its stats, rank 1 checks its own."""
    from torch.distributed.tensor import DTensor

    real, calls = DTensor.full_tensor, []

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    DTensor.full_tensor = counted
    try:
        state, stats = fsdp2(rank)
    finally:
        DTensor.full_tensor = real
    if rank == 0:
        return state, {**stats, "full_tensor_calls": len(calls)}
    assert calls == [], f"rank 1 made {len(calls)} per-parameter gathers"
    return state, stats


def q_only_lora():
    """LoRA r=3 on q_proj alone (5 -> 9): A (3, 5), B (9, 3), the same seeded values on every rank."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(Tiny(5, 9), LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj"], init_lora_weights=False))


def fsdp1_one_slice_on_a_rank(rank):
    """FSDP1 over q_only_lora: the flat parameter is q's weight (45), bias (9), A (15), B (27), then v's weight and
    bias, each start aligned to 4 elements; split in two halves of 79, rank 0 holds A and B's first 3 elements, rank 1
    the rest of B alone: one LoRA slice."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(q_only_lora(), use_orig_params=True, device_id=torch.device("cpu"))
    flat = model._handle.flat_param
    held = [tuple(shape) for shape, info in zip(flat._shapes, flat._shard_param_infos) if info.in_shard]
    lora = [shape for shape in held if shape in ((3, 5), (9, 3))]
    assert lora == [[(3, 5), (9, 3)], [(9, 3)]][rank], held  # the layout under test
    return _gather(accelerator(rank, "fsdp", is_fsdp2=False), model)


def fsdp2_other_layout(rank):
    """DTensors sharded on dim 1 (another layout than FSDP2's): the per-parameter DTensor gather is used."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = peft_model()
    mesh = init_device_mesh("cpu", (WORLD,))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if "lora_" in name or "lora_" in type(module).__name__ or param.requires_grad:
                module.register_parameter(name, torch.nn.Parameter(distribute_tensor(param.data, mesh, [Shard(1)])))
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert len(lora) == 4 and all(tuple(p.placements) == (Shard(1),) for p in lora)  # the layout under test
    return _gather(accelerator(rank, "fsdp", is_fsdp2=True), model)


def fsdp1(rank, dtype=torch.float32):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(peft_model(dtype=dtype), use_orig_params=True, device_id=torch.device("cpu"))
    # the layout under test: q's lora_B lies across the two ranks' halves of the flat parameter
    flat = model._handle.flat_param
    straddling = [info.intra_param_start_idx for shape, info in zip(flat._shapes, flat._shard_param_infos)
                  if info.in_shard and tuple(shape) == (9, 3)]
    assert dtype != torch.float32 or straddling == [[0], [26]][rank], straddling  # (bf16 aligns differently)
    return _gather(accelerator(rank, "fsdp", is_fsdp2=False), model)


def fsdp2_bf16(rank):
    return fsdp2(rank, torch.bfloat16)


def fsdp1_bf16(rank):
    return fsdp1(rank, torch.bfloat16)


def fsdp1_trainable_base(rank):
    """A base parameter that trains too (q's bias) in the same flat parameter as the LoRA weights: it is not part of
    the adapter, so it is neither sent nor expected."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = peft_model()
    model.base_model.model.q_proj.base_layer.bias.requires_grad_(True)
    return _gather(accelerator(rank, "fsdp", is_fsdp2=False),
                   FSDP(model, use_orig_params=True, device_id=torch.device("cpu")))


def _refused(rank, gather, expected: str) -> tuple:
    """Both ranks must refuse (AssertionError) before any collective; rank 0 returns the message (its test compares
    it), rank 1 checks it here."""
    try:
        gather()
    except AssertionError as exc:
        message = str(exc)
    else:
        message = "(no refusal)"
    if rank == 0:
        return message, {}
    assert message == expected, message
    return None, {"gathered_bytes": 0}


def fsdp1_not_resharded(rank):
    """A gather while FSDP1 holds the full flat parameter (inside summon_full_params): the shard offsets would read
    the wrong elements."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(peft_model(), use_orig_params=True, device_id=torch.device("cpu"))
    with FSDP.summon_full_params(model):
        assert model._handle.uses_sharded_strategy  # the layout under test: sharded, but unsharded right now
        return _refused(rank, lambda: gather_lora_state(accelerator(rank, "fsdp", is_fsdp2=False), model),
                        NOT_RESHARDED)


def fsdp1_flat_params_only(rank):
    """FSDP1 without use_orig_params (a flat parameter that does not keep the original ones; every parameter must
    then train, FSDP1 refuses mixed requires_grad)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = peft_model()
    for param in model.parameters():
        param.requires_grad_(True)
    model = FSDP(model, use_orig_params=False, device_id=torch.device("cpu"))
    return _refused(rank, lambda: gather_lora_state(accelerator(rank, "fsdp", is_fsdp2=False), model),
                    NO_ORIG_PARAMS)


def fsdp1_nested(rank):
    """An FSDP unit per LoRA-wrapped projection inside the root unit (which then holds no parameter of its own), the
    layout transformers' auto-wrap gives; after a forward, so FSDP's lazy init has run."""
    from peft.tuners.lora import Linear as LoraLinear
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FSDP(peft_model(), use_orig_params=True, device_id=torch.device("cpu"),
                 auto_wrap_policy=ModuleWrapPolicy({LoraLinear}))
    assert len(FSDP.fsdp_modules(model)) == 3 and model._handle is None  # the layout under test
    model(torch.ones(2, 5))
    return _gather(accelerator(rank, "fsdp", is_fsdp2=False), model)


def fsdp1_no_shard(rank):
    """NO_SHARD: every rank holds every parameter whole; rank 0's copy is the adapter."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    model = FSDP(peft_model(), use_orig_params=True, device_id=torch.device("cpu"),
                 sharding_strategy=ShardingStrategy.NO_SHARD)
    return _gather(accelerator(rank, "fsdp", is_fsdp2=False), model)


def zero3(rank):
    """ZeRO-3's layout: every parameter flattened, padded to a multiple of the ranks, rank r holding elements
    [r*k, (r+1)*k) in `ds_tensor`."""
    model = peft_model()
    for _, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        k = math.ceil(flat.numel() / WORLD)
        padded = torch.cat([flat, torch.full((k * WORLD - flat.numel(),), float("nan"))])  # padding never read
        param.ds_tensor, param.ds_numel, param.ds_shape = padded[rank * k:(rank + 1) * k].clone(), flat.numel(), \
            param.shape
    acc = accelerator(rank, "deepspeed", state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    return _gather(acc, model)


SCENARIOS = {f.__name__: f for f in (ddp, zero2, fsdp2, fsdp2_other_layout, fsdp1, fsdp1_nested, fsdp1_no_shard,
                                     zero3, fsdp2_bf16, fsdp1_bf16, fsdp1_trainable_base, fsdp1_not_resharded,
                                     fsdp1_flat_params_only, fsdp2_one_message, fsdp1_one_slice_on_a_rank)}
NOT_RESHARDED = "FSDP1 flat parameter is not resharded at sync time"
NO_ORIG_PARAMS = "FSDP1 needs use_orig_params=True (see launch/accelerate/fsdp1.yaml)"


# ---- the tests (rank 0) ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    with two_ranks(tmp_path_factory.mktemp("gather"), SCENARIOS) as run:
        def rank_0s(name: str):
            result, rank1 = run(name)
            assert rank1 == (None, {"gathered_bytes": 0}), "only rank 0 gets the tensors and counts bytes"
            return result

        yield rank_0s


def assert_exact(state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    expected = expected_state(dtype)
    assert sorted(state) == sorted(expected) and len(state) == 4  # PEFT's saved key names, A and B of q and v
    for key, tensor in expected.items():
        assert state[key].dtype == dtype == tensor.dtype, key
        assert state[key].shape == tensor.shape and torch.equal(state[key], tensor), key
        assert state[key].device.type == "cpu"


def lora_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in expected_state().values())


@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_replicated_backends_copy_rank_0s_adapter(ranks, backend):
    state, stats = ranks(backend)
    assert_exact(state)
    assert stats["gathered_bytes"] == lora_bytes()


def test_fsdp2_reassembles_uneven_dim0_shards_into_the_full_adapter(ranks):
    state, stats = ranks("fsdp2")
    assert_exact(state)
    # Rank 0 holds the first ceil(n / 2) rows of each tensor, rank 1 the rest: unequal buffers, each sent at its
    # own size, so exactly the adapter's bytes move (padding both to rank 0's length moved 52 more here).
    rank0 = sum(math.ceil(t.shape[0] / WORLD) * t[0].numel() for t in expected_state().values())
    assert rank0 == 2 * 5 + 5 * 3 + 2 * 9 + 3 * 3 and rank0 * 4 > lora_bytes() / 2  # the shards are uneven
    assert stats["gathered_bytes"] == lora_bytes()


def test_fsdp2_dim0_shards_travel_in_one_buffer_per_rank_not_one_gather_per_parameter(ranks):
    state, stats = ranks("fsdp2_one_message")
    assert_exact(state)
    assert stats == {"gathered_bytes": lora_bytes(), "full_tensor_calls": 0}


def test_fsdp1_a_rank_holding_a_single_lora_slice_sends_it(ranks):
    from peft import get_peft_model_state_dict

    state, stats = ranks("fsdp1_one_slice_on_a_rank")
    expected = get_peft_model_state_dict(q_only_lora())
    assert sorted(state) == sorted(expected) and len(state) == 2
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key
    assert stats["gathered_bytes"] == (15 + 27) * 4


def test_dtensors_not_sharded_on_dim0_are_gathered_whole_one_by_one(ranks):
    state, stats = ranks("fsdp2_other_layout")
    assert_exact(state)
    assert stats["gathered_bytes"] == lora_bytes()


def test_fsdp1_puts_each_ranks_slice_at_its_offset_in_the_flat_parameter(ranks):
    # One FSDP unit: its flat parameter (q's weight 45, bias 9, A 15, B 27, then v's, each start aligned to 4
    # elements) is split in two halves of 102, so q's lora_B (elements 76-102) straddles the two ranks: rank 0
    # holds its first 26 elements, rank 1 the last one (the scenario checks this layout before gathering).
    state, stats = ranks("fsdp1")
    assert_exact(state)
    assert stats["gathered_bytes"] == lora_bytes()  # every LoRA element once, no base weight


@pytest.mark.filterwarnings("ignore:.*has both parameters with requires_grad=True and False:UserWarning")  # LoRA's way
@pytest.mark.filterwarnings("ignore:The `NO_SHARD` sharding strategy is deprecated:FutureWarning")
@pytest.mark.parametrize("layout", ["fsdp1_nested", "fsdp1_no_shard"])
def test_fsdp1_nested_units_and_no_shard_give_the_same_adapter(ranks, layout):
    state, stats = ranks(layout)
    assert_exact(state)
    assert stats["gathered_bytes"] == lora_bytes()  # NO_SHARD: rank 0's copy only, not one per rank


def test_zero3_cuts_each_parameter_out_of_the_gathered_partitions(ranks):
    state, stats = ranks("zero3")
    assert_exact(state)
    partition_elements = sum(math.ceil(t.numel() / WORLD) for t in expected_state().values())
    assert stats["gathered_bytes"] == WORLD * partition_elements * 4  # the partitions, padding included


def test_zero3_without_partitioned_parameters_copies_them_like_ddp():
    # ZeRO-3 on one rank leaves parameters whole (no ds_tensor): no collective at all
    acc = accelerator(0, "deepspeed", state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    stats = {}
    assert_exact(gather_lora_state(acc, peft_model(), stats))
    assert stats["gathered_bytes"] == lora_bytes()


def test_an_unsupported_backend_is_refused_with_the_launch_configs_named():
    acc = accelerator(0, "deepspeed", state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=0)))
    with pytest.raises(AsyncGRPOError, match="the zero0 backend is not supported.*launch/accelerate/"):
        gather_lora_state(acc, peft_model())


@pytest.mark.parametrize("backend", ["fsdp1", "fsdp2"])
def test_a_bf16_adapter_is_gathered_in_bf16_bit_for_bit(ranks, backend):
    # the buffers rank 0 reassembles from must have the adapter's dtype, not torch's default float32
    state, stats = ranks(f"{backend}_bf16")
    assert_exact(state, torch.bfloat16)
    assert stats["gathered_bytes"] == lora_bytes() // 2  # the fp32 adapter's elements at 2 bytes each


@pytest.mark.filterwarnings("ignore:.*has both parameters with requires_grad=True and False:UserWarning")
def test_fsdp1_leaves_out_a_base_parameter_that_also_trains(ranks):
    state, stats = ranks("fsdp1_trainable_base")
    assert_exact(state)  # the four LoRA tensors only: q's bias is no adapter weight
    assert stats["gathered_bytes"] == lora_bytes()


def test_fsdp1_refuses_to_gather_while_the_flat_parameter_is_unsharded(ranks):
    message, _ = ranks("fsdp1_not_resharded")
    assert message == NOT_RESHARDED


def test_fsdp1_without_use_orig_params_is_refused_with_the_launch_config_named(ranks):
    message, _ = ranks("fsdp1_flat_params_only")
    assert message == NO_ORIG_PARAMS


# ---- one process: no collective involved -----------------------------------------------------------------------------
def test_an_fsdp_accelerator_without_is_fsdp2_runs_fsdp1():
    # accelerate releases before FSDP2 support have no `is_fsdp2` attribute at all
    assert backend_of(accelerator(0, "fsdp")) == "fsdp1"
    assert backend_of(accelerator(0, "fsdp", is_fsdp2=False)) == "fsdp1"
    assert backend_of(accelerator(0, "fsdp", is_fsdp2=True)) == "fsdp2"


def test_the_adapter_is_the_lora_parameters_that_train():
    model = peft_model()
    model.base_model.model.q_proj.base_layer.bias.requires_grad_(True)  # trains, but is no LoRA weight
    model.base_model.model.v_proj.lora_B.default.weight.requires_grad_(False)  # a LoRA weight frozen
    assert [n for n, _ in lora_parameters(model)] == [
        "base_model.model.q_proj.lora_A.default.weight", "base_model.model.q_proj.lora_B.default.weight",
        "base_model.model.v_proj.lora_A.default.weight"]


def _step(model) -> None:
    """What an optimizer step does to the adapter after a sync: change its parameters in place."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(1.0)


def test_the_ddp_gather_is_a_copy_that_a_later_optimizer_step_does_not_change():
    model = peft_model()
    state = gather_lora_state(accelerator(0, "ddp"), model)
    _step(model)
    assert_exact(state)


def test_fsdp2_parameters_left_whole_are_copied_as_they_are():
    # fully_shard never applied (no DTensors): the per-parameter fallback copies the plain tensors
    model = peft_model()
    stats = {}
    state = gather_lora_state(accelerator(0, "fsdp", is_fsdp2=True), model, stats)
    _step(model)
    assert_exact(state)
    assert stats["gathered_bytes"] == lora_bytes()


def test_fsdp_wrapper_names_are_removed_from_parameter_names():
    wrapped = ("_fsdp_wrapped_module.base_model.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module."
               "q_proj.lora_A.default.weight")
    assert clean_fsdp_name(wrapped) == "base_model.model.layers.0.q_proj.lora_A.default.weight"
