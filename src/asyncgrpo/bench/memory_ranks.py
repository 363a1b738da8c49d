"""`asyncgrpo bench memory --model shape:NAME --backend ddp,fsdp2,zero3 [--variants ...] --json`: the peak memory of
each rank during one training step of a real-shape model, two CPU ranks per backend.

Each (backend, variant) is one `accelerate launch` of this module's worker, which builds the trainer's model and runs
the trainer's own step (`GRPORecipe._optimise`) on a synthetic batch. What is measured: docs/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from asyncgrpo.bench.sync import cpu_launch_env
from asyncgrpo.children import run_group
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.demo import default_config_path
from asyncgrpo.errors import AsyncGRPOError, ConfigError
from asyncgrpo.inference_node.vllm_server import find_free_port
from asyncgrpo.toy.shapes import shape_model_dir

# default: what a user should run (gradient checkpointing on, the chunked LM head); the others each turn one off.
VARIANTS = ("default", "no_checkpointing", "no_chunking")
SHARDED = ("ddp", "fsdp1", "fsdp2", "zero2", "zero3")
REPO = Path(__file__).resolve().parents[3]


def _status_kib(field_name: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS: now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise AsyncGRPOError(f"/proc/self/status has no {field_name}: this benchmark measures Linux processes")


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to clear_refs), so the next peak is the step's own."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(argv: list[str]) -> None:
    """Every rank: build the trainer's model, take one step on `completions` x `completion_tokens`, report memory."""
    # heavy: torch and the trainer, in the launched ranks only
    import torch

    from asyncgrpo.bench.backend_check import micro_batches, synthetic_share
    from asyncgrpo.distributed import all_gather_object, leave_launched_process
    from asyncgrpo.trainer.gather import backend_of
    from asyncgrpo.trainer.metrics import StepMetrics
    from asyncgrpo.trainer.recipe import GRPORecipe

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--completions", type=int, required=True)
    parser.add_argument("--completion_tokens", type=int, required=True)
    parser.add_argument("--prompt_tokens", type=int, required=True)
    args, overrides = parser.parse_known_args(argv)
    out = Path(args.out)
    cfg = AsyncGRPOConfig.load(default_config_path(), [
        "--torch_num_threads", "1", "--ddp_timeout", "3600", "--output_dir", str(out.parent),
        "--lora_adapter_path", str(out.parent / "adapters"),
        "--gradient_checkpointing", str(args.variant != "no_checkpointing").lower(), *overrides])
    trainer = GRPORecipe(cfg)
    trainer.setup_model()
    if args.variant == "no_chunking":
        trainer.scoring_head = None  # the full (B, T, V) logits, as a trainer without the chunked head computes
    load_peak_kib, loaded_kib = _status_kib("VmHWM"), _status_kib("VmRSS")
    vocab = trainer.acc.unwrap_model(trainer.model).config.vocab_size
    if args.completions % trainer.world:
        raise ConfigError("--completions", f"{args.completions} does not split over {trainer.world} ranks",
                          "give a multiple of the number of ranks")
    share = synthetic_share(trainer.rank, trainer.world, 1, args.completions // trainer.world, 0, vocab,
                            (args.prompt_tokens, args.prompt_tokens + 1),
                            (args.completion_tokens, args.completion_tokens + 1))
    uniform = -float(torch.log(torch.tensor(float(vocab))))  # a random model's logprob: ratios near 1
    for group in share:
        group.behaviour_logprobs = [[uniform] * len(c) for c in group.completion_ids]
    batches = micro_batches(trainer, share, 1)
    metrics = StepMetrics()
    _reset_peak()
    started = time.perf_counter()
    trainer._optimise(batches, metrics)
    step_s = time.perf_counter() - started
    row = {"rank": trainer.rank, "loaded_gib": loaded_kib / 2**20, "load_peak_gib": load_peak_kib / 2**20,
           "step_peak_gib": _status_kib("VmHWM") / 2**20, "step_s": round(step_s, 2),
           "loss": metrics.values["train/loss"]}
    rows = all_gather_object(row)
    if trainer.main:
        model = trainer.acc.unwrap_model(trainer.model)
        out.write_text(json.dumps({
            "backend": backend_of(trainer.acc), "variant": args.variant, "world_size": trainer.world,
            "model": cfg.model_name_or_path, "torch_dtype": cfg.torch_dtype, "lora_r": cfg.lora_r,
            "gradient_checkpointing": cfg.gradient_checkpointing, "chunked_head": trainer.scoring_head is not None,
            "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),  # ZeRO-3: full size
            "tokens": metrics.values["train/tokens"],
            "ranks": sorted(rows, key=lambda r: r["rank"])}))
    trainer.acc.wait_for_everyone()
    trainer.acc.end_training()
    leave_launched_process(0)


def launch(backend: str, variant: str, model: str, work: Path, *, completions: int, completion_tokens: int,
           prompt_tokens: int, overrides: list[str], timeout_s: float) -> dict:
    """One two-rank CPU launch of the worker; its JSON."""
    out = work / f"{backend}-{variant}" / "result.json"
    out.parent.mkdir(parents=True)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "launch" / "accelerate" / f"{backend}_cpu.yaml"), "--main_process_port", str(find_free_port()),
           "-m", "asyncgrpo.bench.memory_ranks", "--out", str(out), "--variant", variant,
           "--completions", str(completions), "--completion_tokens", str(completion_tokens),
           "--prompt_tokens", str(prompt_tokens), "--model_name_or_path", model, *overrides]
    print(f"bench memory: {backend} {variant} ({completions} x {completion_tokens} tokens)...", file=sys.stderr,
          flush=True)
    proc = run_group(cmd, cwd=REPO, env=cpu_launch_env(backend, large_model=True), capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0 or not out.exists():
        raise AsyncGRPOError(f"bench memory worker for {backend}/{variant} failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def run(model: str, backends: list[str], variants: list[str], *, completions: int = 8, completion_tokens: int = 512,
        prompt_tokens: int = 64, overrides: list[str] | None = None, timeout_s: float = 3600) -> dict:
    """Every backend x variant, one after another; each rank's peak beside the others'."""
    for name, given, allowed in (("--backend", backends, SHARDED), ("--variants", variants, VARIANTS)):
        if not given or not set(given) <= set(allowed):
            raise ConfigError(name, f"{','.join(given)!r} is not a list of {', '.join(allowed)}", "pick from those")
    overrides = overrides or []
    cfg = AsyncGRPOConfig.load(default_config_path(), overrides)
    model_dir = model
    if model.startswith("shape:"):
        model_dir = str(shape_model_dir(model, cfg.torch_dtype, os.environ.get("ASYNCGRPO_CACHE")))
    runs = []
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-bench-memory-") as work:
        for backend in backends:
            for variant in variants:
                runs.append(launch(backend, variant, model_dir, Path(work), completions=completions,
                                   completion_tokens=completion_tokens, prompt_tokens=prompt_tokens,
                                   overrides=overrides, timeout_s=timeout_s))
    return {"model": model, "torch_dtype": cfg.torch_dtype, "completions": completions,
            "completion_tokens": completion_tokens, "prompt_tokens": prompt_tokens, "measure": "VmHWM per rank",
            "runs": runs}


if __name__ == "__main__":
    worker(sys.argv[1:])
