"""Run under `accelerate launch` by test_backend_step.py (not a test itself): the trainer's model on whichever
backend was launched, no inference server. Rank 0 writes `result.json` (and `update.safetensors`) to --out.

1. One warm-up optimizer step (so Adam has history), then a checkpoint of that state.
2. Step A: the next global batch as ONE micro-batch per rank; the LoRA weights gathered after it.
3. The checkpoint restored; step B: the same batch as --micro micro-batches per rank, with every tensor asyncgrpo
   hands to torch.distributed recorded (`DeviceAudit`), and the gather after it audited too.

The test then requires A == B, one optimizer step each, every audited tensor on the collective device, and the
rotary buffers still fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

COLLECTIVES = ("all_reduce", "all_gather", "gather", "broadcast", "reduce", "scatter", "reduce_scatter",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "send", "recv")


class DeviceAudit:
    """Makes the collective device `meta` (a device that is not the CPU, as a GPU is under NCCL) and records the
    device of every tensor that code in asyncgrpo hands to a torch.distributed collective. Tensors moved through
    `asyncgrpo.distributed.to_collective` get a CPU twin that the real (gloo) collective runs on, and `to_host`
    returns the twin: code that follows the rule keeps working; a CPU tensor handed straight to a collective is
    recorded as `cpu`, and a meta result read without `to_host` fails loudly."""

    def __init__(self):
        self.records: list[dict] = []
        self._twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta) -> (meta, cpu twin)

    def __enter__(self):
        import asyncgrpo.distributed as D

        self._module = D
        self._saved = {"collective_device": D.collective_device, "_transfer": D._transfer}
        self._saved_dist = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        D.collective_device = lambda: torch.device("meta")
        D._transfer = self._transfer
        for name, original in self._saved_dist.items():
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(self._module, name, original)
        for name, original in self._saved_dist.items():
            setattr(dist, name, original)

    def _keep(self, meta: torch.Tensor, twin: torch.Tensor) -> torch.Tensor:
        self._twins[id(meta)] = (meta, twin)
        return meta

    def _transfer(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type == "meta":
            return self._keep(torch.empty_like(tensor, device="meta"), tensor.detach().to("cpu", copy=True))
        if tensor.device.type == "meta":
            return self._twin(tensor).to(device)
        return tensor.to(device)

    def _twin(self, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "meta":
            return tensor
        if id(tensor) not in self._twins:  # an output buffer the code made on the collective device
            self._keep(tensor, torch.zeros(tensor.shape, dtype=tensor.dtype))
        return self._twins[id(tensor)][1]

    def _map(self, value):
        if isinstance(value, (list, tuple)):
            return type(value)(self._twin(v) for v in value)
        return self._twin(value)

    def _wrap(self, name, original):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith("asyncgrpo"):  # accelerate/torch/DeepSpeed internals manage their own devices
                return original(*args, **kwargs)
            tensors = [t for v in (*args, *kwargs.values()) for t in (v if isinstance(v, (list, tuple)) else [v])
                       if isinstance(t, torch.Tensor)]
            self.records.append({"op": name, "caller": caller, "devices": sorted({str(t.device) for t in tensors})})
            return original(*[self._map(a) for a in args], **{k: self._map(v) for k, v in kwargs.items()})

        return call


def synthetic_share(rank: int, world: int, groups_per_rank: int, generations: int, seed: int):
    """This rank's groups of a fixed global batch: prompts and completions of different lengths (padding inside a
    micro-batch), advantages of both signs. Behaviour logprobs are filled in later from the model itself."""
    from asyncgrpo.contracts import Group

    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(groups_per_rank * world):
        prompt = torch.randint(3, 60, (int(torch.randint(4, 9, (1,), generator=gen)),), generator=gen).tolist()
        completions = [torch.randint(3, 60, (int(torch.randint(2, 6, (1,), generator=gen)),), generator=gen).tolist()
                       for _ in range(generations)]
        advantages = (torch.randn(generations, generator=gen)).tolist()
        groups.append(Group(prompt="", prompt_ids=prompt, completion_ids=completions,
                            behaviour_logprobs=[[0.0] * len(c) for c in completions], rewards=[0.0] * generations,
                            reward_parts={}, advantages=advantages, version=0, adapter="", index=g))
    return groups[rank::world]


def with_behaviour(trainer, share, seed: int):
    """The model's own logprobs, shifted by a little noise: ratios near 1, some clipped."""
    gen = torch.Generator().manual_seed(seed + 1000 * trainer.rank)
    for g in share:
        scored = trainer.score([g.prompt_ids] * len(g.completion_ids), g.completion_ids)
        g.behaviour_logprobs = [[lp + 0.3 * float(torch.randn(1, generator=gen)) for lp in lps] for lps in scored]
    return share


def micro_batches(trainer, share, n: int):
    from asyncgrpo.trainer.batching import collate, to_device

    size = -(-len(share) // n)
    return [to_device(collate(share[i:i + size], trainer.pad_id), trainer.acc.device)
            for i in range(0, len(share), size)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args, overrides = parser.parse_known_args()

    from asyncgrpo.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.demo import default_config_path
    from asyncgrpo.trainer.gather import backend_of, gather_lora_state
    from asyncgrpo.trainer.recipe import AsyncGRPOTrainer
    from asyncgrpo.trainer.metrics import StepMetrics

    out = Path(args.out)
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--torch_dtype", args.dtype, "--learning_rate", "1e-3", "--max_grad_norm", "0.05", "--ddp_timeout", "200", "--vllm_server_timeout", "30", "--vllm_request_timeout", "40",
        "--output_dir", str(out), "--lora_adapter_path", str(out / "adapters"), *overrides])
    trainer = AsyncGRPOTrainer(cfg)
    trainer.setup_model()
    steps = []
    register_optimizer_step_post_hook(lambda *a: steps.append(1))

    warmup = with_behaviour(trainer, synthetic_share(trainer.rank, trainer.world, 4, 4, seed=1), seed=1)
    trainer._optimise(micro_batches(trainer, warmup, 1), StepMetrics())
    state = TrainerState(step=1, version=1, data_position=0, run_id="worker", backend=backend_of(trainer.acc),
                         world_size=trainer.world)
    path = Path(str(save_checkpoint(trainer.acc, trainer.model, trainer.optimizer, state, output_dir=cfg.output_dir,
                                    peft_config=trainer.peft_config, base_model="toy")))
    path = Path(trainer_broadcast(str(path) if trainer.main else None))
    share = with_behaviour(trainer, synthetic_share(trainer.rank, trainer.world, 4, 4, seed=2), seed=2)

    before = len(steps)
    stats_a = StepMetrics()
    trainer._optimise(micro_batches(trainer, share, 1), stats_a)
    steps_a = len(steps) - before
    update_a = gather_lora_state(trainer.acc, trainer.model)

    load_checkpoint(path, trainer.acc, trainer.model, trainer.optimizer)
    before = len(steps)
    stats_b = StepMetrics()
    with DeviceAudit() as audit:
        trainer._optimise(micro_batches(trainer, share, args.micro), stats_b)
        steps_b = len(steps) - before
        update_b = gather_lora_state(trainer.acc, trainer.model)
    all_records = gather_records(audit.records)

    if trainer.main:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in update_a.items()}, str(out / "update.safetensors"))
        model = trainer.acc.unwrap_model(trainer.model)
        result = {
            "backend": backend_of(trainer.acc), "world_size": trainer.world, "micro": args.micro,
            "optimizer_steps_a": steps_a, "optimizer_steps_b": steps_b,
            "max_abs_diff_a_b": max(float((update_a[k] - update_b[k]).abs().max()) for k in update_a),
            "loss_a": stats_a.values["train/loss"], "loss_b": stats_b.values["train/loss"],
            "tokens_a": stats_a.values["train/tokens"], "tokens_b": stats_b.values["train/tokens"],
            "audit": all_records,
            "inv_freq_dtypes": sorted({str(b.dtype) for n, b in model.named_buffers() if "inv_freq" in n}),
            "mixed_precision": trainer.acc.mixed_precision,
        }
        plugin = getattr(trainer.acc.state, "fsdp_plugin", None)
        policy = getattr(plugin, "mixed_precision_policy", None) if plugin is not None else None
        result["fsdp_reduce_dtype"] = str(getattr(policy, "reduce_dtype", None))
        ds = getattr(trainer.acc.state, "deepspeed_plugin", None)
        result["deepspeed_gradient_clipping"] = ds.deepspeed_config.get("gradient_clipping") if ds else None
        (out / "result.json").write_text(json.dumps(result, indent=1))
    trainer.acc.wait_for_everyone()
    trainer.acc.end_training()
    from asyncgrpo.distributed import leave_launched_process

    leave_launched_process(0)  # as `asyncgrpo train` does: no interpreter finalization after a finished run


def trainer_broadcast(obj):
    from asyncgrpo.distributed import broadcast_object

    return broadcast_object(obj)


def gather_records(records: list[dict]) -> list[dict]:
    from asyncgrpo.distributed import is_distributed

    if not is_distributed():
        return records
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, records)
    return [r for rank_records in box for r in rank_records]


if __name__ == "__main__":
    main()
