"""One launch's check of the trainer's own training path on the backend it was launched with (gpu_check's worker).

    accelerate launch --config_file launch/accelerate/fsdp2.yaml --num_processes 1 \\
        -m asyncgrpo.bench.backend_check --out DIR [--micro 2] [--KEY VALUE config overrides]

No inference server: the batches are synthetic, the behaviour logprobs the model's own. Rank 0 writes DIR/result.json
(`run_check`'s figures), DIR/before.safetensors and DIR/update.safetensors (the adapter before and after step A, for
gpu_check's comparison of backends); `failures(result)` says what a result fails (docs/gpus.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.contracts import Group
from asyncgrpo.demo import default_config_path
from asyncgrpo.distributed import all_gather_object, broadcast_object, leave_launched_process
from asyncgrpo.trainer.batching import collate, to_device
from asyncgrpo.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
from asyncgrpo.trainer.gather import backend_of, gather_lora_state
from asyncgrpo.trainer.logprobs import sequence_logprobs
from asyncgrpo.trainer.metrics import StepMetrics
from asyncgrpo.trainer.recipe import GRPORecipe

# What a result must show (`failures`). 1 vs 2 micro-batches: the relative L2 distance of the two updates (Adam
# moves each weight by about the learning rate whatever its gradient, so a weight whose gradient is rounding noise
# may flip: the largest single difference says little). bf16 bases cut the same computation into other matmul
# shapes and differ by bf16 rounding: 0.044 (FSDP1) and 0.047 (FSDP2) on the toy model under gloo.
BOUNDS = {"float32": {"update_rel": 0.01, "chunked_abs": 1e-4, "on_policy_abs": 1e-4},
          "bfloat16": {"update_rel": 0.1, "chunked_abs": 0.05, "on_policy_abs": 0.05}}


# Peak memory during step A, GiB: CUDA's peak allocation on the GPU, the process's peak resident set on CPU.
# GPU (Qwen2.5-1.5B's shape, bf16, LoRA r16, 16 sequences of <= 768 tokens, no gradient checkpointing): estimated
# ~25 GiB (the base 2.9 GiB; activations of ~10k tokens through 28 layers ~20 GiB; the chunked head keeps the
# 151,936-word logits to one chunk); 48 GiB leaves the estimate room and still fails a base held twice in fp32 (+12
# GiB) together with whole-batch fp32 logits (+7 GiB per copy). Not yet measured on a GPU: the first run's figure
# goes to docs/gpus.md. CPU (the toy model, 2 gloo ranks): torch, transformers and DeepSpeed's imports dominate;
# the highest measured was ~1.2 GiB (docs/gpus.md), bound 3 GiB.
PEAK_MEMORY_GIB = {"cuda": 48.0, "cpu": 3.0}


def synthetic_share(rank: int, world: int, groups_per_rank: int, generations: int, seed: int, vocab: int,
                    prompt_len: tuple[int, int], completion_len: tuple[int, int]) -> list[Group]:
    """This rank's groups of a fixed global batch: prompts and completions of different lengths (padding inside a
    micro-batch), advantages of both signs. Behaviour logprobs are filled in by `with_behaviour`."""
    gen = torch.Generator().manual_seed(seed)

    def ids(lengths):
        return torch.randint(3, vocab, (int(torch.randint(*lengths, (1,), generator=gen)),), generator=gen).tolist()

    groups = []
    for g in range(groups_per_rank * world):
        prompt = ids(prompt_len)
        completions = [ids(completion_len) for _ in range(generations)]
        groups.append(Group(prompt="", prompt_ids=prompt, completion_ids=completions,
                            behaviour_logprobs=[[0.0] * len(c) for c in completions], rewards=[0.0] * generations,
                            reward_parts={}, advantages=torch.randn(generations, generator=gen).tolist(), version=0,
                            adapter="", index=g))
    return groups[rank::world]


def with_behaviour(trainer, share: list[Group], seed: int, noise: float) -> list[Group]:
    """The model's own logprobs as the behaviour policy's, plus `noise` x N(0, 1) per token (0: exactly on policy;
    0.3: ratios near 1 with some clipped)."""
    gen = torch.Generator().manual_seed(seed + 1000 * trainer.rank)
    for g in share:
        scored = trainer.score([g.prompt_ids] * len(g.completion_ids), g.completion_ids)
        g.behaviour_logprobs = [[lp + noise * float(torch.randn(1, generator=gen)) for lp in lps] for lps in scored]
    return share


def micro_batches(trainer, share: list[Group], n: int) -> list[dict]:
    size = -(-len(share) // n)
    return [to_device(collate(share[i:i + size], trainer.pad_id), trainer.acc.device)
            for i in range(0, len(share), size)]


def chunked_vs_full(trainer, batch: dict) -> float:
    """Max |chunked head - full logits| logprob over the batch's completion tokens."""
    with torch.no_grad():
        args = (batch["input_ids"], batch["attention_mask"], batch["mask"], trainer.cfg.temperature)
        chunked = sequence_logprobs(trainer.model, trainer.scoring_head, *args)
        full = sequence_logprobs(trainer.model, None, *args)
    return float(((chunked - full).abs() * batch["mask"]).max())


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device) -> float:
    """CUDA: the device's peak allocation; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_check(cfg: AsyncGRPOConfig, out: Path, micro: int, shape: dict, audit=contextlib.nullcontext):
    """Every rank: build the trainer's model, take an on-policy step (its ratio), checkpoint, step A (the next batch
    as one micro-batch per rank), restore, step B (the same batch as `micro` micro-batches, inside `audit()`), each
    followed by the LoRA gather. Returns (the accelerator, the figures on rank 0, None elsewhere)."""
    trainer = GRPORecipe(cfg)
    trainer.setup_model()
    device = trainer.acc.device
    vocab = trainer.acc.unwrap_model(trainer.model).config.vocab_size
    steps: list[int] = []
    register_optimizer_step_post_hook(lambda *a: steps.append(1))

    def share(seed: int, noise: float) -> list[Group]:
        groups = synthetic_share(trainer.rank, trainer.world, shape["groups"], shape["generations"], seed,
                                 min(vocab, 60) if shape["small_ids"] else vocab, shape["prompt_len"],
                                 shape["completion_len"])
        return with_behaviour(trainer, groups, seed, noise)

    on_policy = StepMetrics()
    trainer._optimise(micro_batches(trainer, share(1, 0.0), 1), on_policy)  # also gives Adam a history
    state = TrainerState(step=1, version=1, data_position=0, run_id="backend-check", backend=backend_of(trainer.acc),
                         world_size=trainer.world)
    path = save_checkpoint(trainer.acc, trainer.model, trainer.optimizer, state, output_dir=cfg.output_dir,
                           peft_config=trainer.peft_config, base_model=cfg.model_name_or_path)
    path = Path(broadcast_object(str(path) if trainer.main else None))
    batch_share = share(2, 0.3)
    before_step = gather_lora_state(trainer.acc, trainer.model)
    chunked = chunked_vs_full(trainer, micro_batches(trainer, batch_share, 1)[0])

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = len(steps)
    stats_a = StepMetrics()
    batches = micro_batches(trainer, batch_share, 1)
    _synchronize(device)
    started = time.perf_counter()
    trainer._optimise(batches, stats_a)
    _synchronize(device)
    step_s = time.perf_counter() - started
    peak = peak_memory_gib(device)
    steps_a = len(steps) - first
    gather_stats: dict = {}
    update_a = gather_lora_state(trainer.acc, trainer.model, gather_stats)

    load_checkpoint(path, trainer.acc, trainer.model, trainer.optimizer)
    first = len(steps)
    stats_b = StepMetrics()
    with audit() as recorder:
        trainer._optimise(micro_batches(trainer, batch_share, micro), stats_b)
        steps_b = len(steps) - first
        update_b = gather_lora_state(trainer.acc, trainer.model)
    records = getattr(recorder, "records", None)
    if records is not None:  # every rank's, on rank 0
        records = [r for rank_records in all_gather_object(records) for r in rank_records]
    if not trainer.main:
        return trainer.acc, None
    from safetensors.torch import save_file  # heavy: only rank 0 writes the update

    save_file({k: v.contiguous() for k, v in update_a.items()}, str(out / "update.safetensors"))
    save_file({k: v.contiguous() for k, v in before_step.items()}, str(out / "before.safetensors"))
    model = trainer.acc.unwrap_model(trainer.model)
    step_size = max(float((update_a[k].float() - before_step[k].float()).abs().max()) for k in update_a)
    a_vs_b = max(float((update_a[k].float() - update_b[k].float()).abs().max()) for k in update_a)
    step_norm = math.sqrt(sum(float((update_a[k].float() - before_step[k].float()).square().sum()) for k in update_a))
    a_vs_b_norm = math.sqrt(sum(float((update_a[k].float() - update_b[k].float()).square().sum()) for k in update_a))
    plugin = getattr(trainer.acc.state, "fsdp_plugin", None)
    policy = getattr(plugin, "mixed_precision_policy", None) if plugin is not None else None
    ds = getattr(trainer.acc.state, "deepspeed_plugin", None)
    return trainer.acc, {
        "backend": backend_of(trainer.acc), "world_size": trainer.world, "micro": micro, "device": str(device),
        "dtype": cfg.torch_dtype, "model": cfg.model_name_or_path,
        "parameters": sum(p.numel() for p in model.parameters()),
        "optimizer_steps_a": steps_a, "optimizer_steps_b": steps_b,
        "loss_on_policy": on_policy.values["train/loss"], "loss_a": stats_a.values["train/loss"],
        "loss_b": stats_b.values["train/loss"],
        "tokens_a": stats_a.values["train/tokens"], "tokens_b": stats_b.values["train/tokens"],
        "max_abs_diff_a_b": a_vs_b, "step_size": step_size,
        "update_rel_diff_a_b": a_vs_b_norm / step_norm if step_norm > 0 else math.inf,
        "on_policy_max_abs_log_ratio": on_policy.values["train/max_abs_log_ratio"],
        "chunked_vs_full_max_abs": chunked,
        "gathered_bytes": gather_stats["gathered_bytes"],
        "adapter_bytes": sum(t.numel() * t.element_size() for t in update_a.values()),
        "step_time_s": round(step_s, 4), "peak_memory_gib": round(peak, 3),
        "audit": records,
        "inv_freq_dtypes": sorted({str(b.dtype) for n, b in model.named_buffers() if "inv_freq" in n}),
        "mixed_precision": trainer.acc.mixed_precision,
        "fsdp_reduce_dtype": str(getattr(policy, "reduce_dtype", None)),
        "deepspeed_gradient_clipping": ds.deepspeed_config.get("gradient_clipping") if ds else None,
        "max_grad_norm": cfg.max_grad_norm,
    }


def failures(result: dict) -> list[str]:
    """What `result` fails, one line each (empty: it passes)."""
    bounds = BOUNDS["float32" if result["dtype"] == "float32" else "bfloat16"]
    found = []
    losses = [result[k] for k in ("loss_on_policy", "loss_a", "loss_b")]
    if not all(math.isfinite(x) for x in losses):
        found.append(f"a loss is not finite: {losses}")
    if (result["optimizer_steps_a"], result["optimizer_steps_b"]) != (1, 1):
        found.append(f"optimizer steps per trainer step: {result['optimizer_steps_a']} with one micro-batch, "
                     f"{result['optimizer_steps_b']} with {result['micro']}; want 1 and 1")
    if not result["tokens_a"] == result["tokens_b"] > 0:
        found.append(f"tokens counted: {result['tokens_a']} vs {result['tokens_b']}")
    if not result["step_size"] > 0:
        found.append("the step did not move the adapter")
    elif not result["update_rel_diff_a_b"] <= bounds["update_rel"]:
        found.append(f"1 vs {result['micro']} micro-batches: the updates differ by {result['update_rel_diff_a_b']:.3g} "
                     f"of the step's norm, more than {bounds['update_rel']}")
    if not result["chunked_vs_full_max_abs"] <= bounds["chunked_abs"]:
        found.append(f"chunked vs full-logit logprobs differ by {result['chunked_vs_full_max_abs']:.3g}")
    if not result["on_policy_max_abs_log_ratio"] <= bounds["on_policy_abs"]:
        found.append(f"on-policy |log ratio| reached {result['on_policy_max_abs_log_ratio']:.3g}, want ~0")
    if result["gathered_bytes"] > 1.05 * result["adapter_bytes"]:
        found.append(f"the gather moved {result['gathered_bytes']} bytes for a {result['adapter_bytes']}-byte adapter")
    if result["inv_freq_dtypes"] not in ([], ["torch.float32"]):
        found.append(f"rotary inv_freq is {result['inv_freq_dtypes']} after a forward, want float32")
    bound = PEAK_MEMORY_GIB["cuda" if result["device"].startswith("cuda") else "cpu"]
    if not result["peak_memory_gib"] <= bound:
        found.append(f"peak memory {result['peak_memory_gib']} GiB during a step, above the bound of {bound} GiB")
    if result["backend"].startswith("fsdp") and result["mixed_precision"] != "no" \
            and result["fsdp_reduce_dtype"] != "torch.float32":
        found.append(f"FSDP reduces gradients in {result['fsdp_reduce_dtype']} under {result['mixed_precision']} "
                     "mixed precision, want torch.float32")
    if result["backend"].startswith("zero") and result.get("deepspeed_gradient_clipping") != result.get("max_grad_norm"):
        found.append(f"DeepSpeed clips at {result.get('deepspeed_gradient_clipping')}, not max_grad_norm "
                     f"{result.get('max_grad_norm')}")
    return found


def main(argv: list[str] | None = None, audit=contextlib.nullcontext) -> None:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.bench.backend_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4, help="groups per rank")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt_len", type=int, nargs=2, default=[4, 9], help="[low, high) prompt tokens")
    parser.add_argument("--completion_len", type=int, nargs=2, default=[2, 6], help="[low, high) completion tokens")
    args, overrides = parser.parse_known_args(argv)
    out = Path(args.out)
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--learning_rate", "1e-3", "--max_grad_norm", "0.05", "--ddp_timeout", "200", "--vllm_server_timeout", "30",
        "--vllm_request_timeout", "40",
        "--output_dir", str(out), "--lora_adapter_path", str(out / "adapters"), *overrides])
    shape = {"groups": args.groups, "generations": args.generations, "prompt_len": tuple(args.prompt_len),
             "completion_len": tuple(args.completion_len), "small_ids": cfg.model_name_or_path == "toy"}
    trainer_acc, result = run_check(cfg, out, args.micro, shape, audit)
    if result is not None:
        (out / "result.json").write_text(json.dumps(result, indent=1))
    trainer_acc.wait_for_everyone()
    trainer_acc.end_training()
    leave_launched_process(0)  # as `asyncgrpo train` does: no interpreter finalization after a finished run


if __name__ == "__main__":
    main(sys.argv[1:])
