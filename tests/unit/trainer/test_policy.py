"""policy.py: where the base is loaded (straight onto the GPU under DDP and ZeRO-2, nowhere special otherwise)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from asyncgrpo.trainer import policy
from asyncgrpo.trainer.policy import load_placement


def accelerator(device: str, kind: DistributedType, stage: int = 0, fsdp2: bool = False):
    return SimpleNamespace(device=torch.device(device), distributed_type=kind, is_fsdp2=fsdp2,
                           state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage)))


@pytest.mark.parametrize("kind,stage", [(DistributedType.MULTI_GPU, 0), (DistributedType.NO, 0),
                                        (DistributedType.DEEPSPEED, 2)])
def test_ddp_and_zero2_on_a_gpu_read_the_base_onto_their_own_device(kind, stage):
    acc = accelerator("cuda:3", kind, stage)
    assert load_placement(acc) == {"device_map": {"": torch.device("cuda:3")}}


@pytest.mark.parametrize("acc", [accelerator("cuda:1", DistributedType.FSDP, fsdp2=True),
                                 accelerator("cuda:1", DistributedType.FSDP),
                                 accelerator("cuda:1", DistributedType.DEEPSPEED, 3),
                                 accelerator("cpu", DistributedType.MULTI_CPU),
                                 accelerator("cpu", DistributedType.DEEPSPEED, 2)])
def test_sharded_backends_and_cpu_runs_load_as_before(acc):
    assert load_placement(acc) == {}


def test_build_policy_passes_the_placement_to_from_pretrained(monkeypatch, tmp_path):
    seen = {}

    class Stop(Exception):
        pass

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        raise Stop

    import transformers
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: None)
    monkeypatch.setattr(policy, "local_model_dir", lambda path: str(tmp_path))
    monkeypatch.setattr(policy, "load_placement", lambda acc: {"device_map": {"": "marker"}})
    acc = accelerator("cpu", DistributedType.NO)
    acc.local_main_process_first = contextlib.nullcontext
    cfg = SimpleNamespace(seed=0, torch_dtype="float32")
    monkeypatch.setattr(policy, "base_dtype", lambda cfg, acc: "float32")
    with pytest.raises(Stop):
        policy.build_policy(cfg, acc, "some/model")
    assert seen == {"dtype": torch.float32, "device_map": {"": "marker"}}
