"""`scripts/gpu_check.sh`: the trainer's own step on every backend, on one GPU under NCCL; one JSON line out.

    scripts/gpu_check.sh                           # DDP, FSDP1, FSDP2, ZeRO-2, ZeRO-3 on Qwen2.5-1.5B's shape, bf16
    scripts/gpu_check.sh --cpu-smoke --backends ddp   # the same launches on CPU: 2 gloo ranks, the toy model

Each backend is one `accelerate launch` of `asyncgrpo.bench.backend_check` with the real `launch/accelerate/*.yaml`
(`--num_processes 1`); `backend_check.failures` judges each result. Exit 0: all passed, 1: one failed, 2: no CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncgrpo.children import run_group
from asyncgrpo.inference.server import find_free_port

BACKENDS = ("ddp", "fsdp1", "fsdp2", "zero2", "zero3")
REPO = Path(__file__).resolve().parents[3]
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# The batch per rank: GPU sizes are a real GRPO step's (2 groups x 8 completions of up to 512 tokens).
GPU_BATCH = ["--groups", "2", "--generations", "8", "--prompt_len", "64", "257", "--completion_len", "256", "513"]
CPU_BATCH: list[str] = []  # backend_check's defaults: tiny sequences


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, of " + ", ".join(BACKENDS))
    p.add_argument("--model", default=None, help="default shape:qwen2.5-1.5b (GPU), toy (--cpu-smoke)")
    p.add_argument("--dtype", default=None, help="base weights: default bfloat16 (GPU), float32 (--cpu-smoke)")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="launch the CPU variants (launch/accelerate/<backend>_cpu.yaml, 2 gloo ranks, toy model)")
    p.add_argument("--deepspeed-wheels", default=str(REPO / "wheels"),
                   help="folder of wheels to install DeepSpeed from when it is missing (docs/gpus.md says how "
                        "to make it); ZeRO fails its check when neither is there")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}: use {', '.join(BACKENDS)}")
    args.model = args.model or ("toy" if args.cpu_smoke else "shape:qwen2.5-1.5b")
    args.dtype = args.dtype or ("float32" if args.cpu_smoke else "bfloat16")
    return args


def ensure_deepspeed(wheels: Path) -> str | None:
    """None when DeepSpeed imports (installing it from `wheels` first if it is missing), else why not."""
    if importlib.util.find_spec("deepspeed") is not None:
        return None
    if not any(wheels.glob("deepspeed-*")):
        return f"DeepSpeed is not installed and {wheels} holds no deepspeed wheel (docs/gpus.md: carrying DeepSpeed)"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                           "deepspeed"], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"installing DeepSpeed from {wheels} failed: {proc.stderr.strip()[-600:]}"
    importlib.invalidate_caches()
    return None


def launch(backend: str, args, out: Path) -> subprocess.CompletedProcess:
    """One `accelerate launch` of backend_check for `backend`; its result lands in out/result.json."""
    if args.cpu_smoke:
        from asyncgrpo.bench.sync import cpu_launch_env  # heavy: torch, only for the CPU variant's environment

        config, processes, env, batch = f"launch/accelerate/{backend}_cpu.yaml", 2, cpu_launch_env(backend), CPU_BATCH
    else:
        config, processes, batch = f"launch/accelerate/{backend}.yaml", 1, GPU_BATCH
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = f"{REPO / 'src'}:{env.get('PYTHONPATH', '')}".rstrip(":")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes",
           str(processes), "--main_process_port", str(find_free_port()), "-m", "asyncgrpo.bench.backend_check",
           "--out", str(out), *batch, "--model_name_or_path", args.model, "--torch_dtype", args.dtype,
           "--lora_r", str(args.lora_r), "--lora_alpha", str(2 * args.lora_r), "--lora_target_modules", ALL_LINEAR,
           "--gradient_checkpointing", str(args.gradient_checkpointing).lower()]
    return run_group(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)


def check_backend(backend: str, args, work: Path) -> dict:
    """Launch one backend and judge its result: {ok, failures, figures...}."""
    from asyncgrpo.bench.backend_check import failures  # heavy: the trainer (torch), after the argument checks

    if backend.startswith("zero"):
        missing = ensure_deepspeed(Path(args.deepspeed_wheels))
        if missing:
            return {"ok": False, "failures": [missing]}
    out = work / backend
    out.mkdir()
    started = time.perf_counter()
    try:
        proc = launch(backend, args, out)
    except subprocess.TimeoutExpired:
        return {"ok": False, "failures": [f"the launch ran past {args.timeout:.0f} s"]}
    wall = round(time.perf_counter() - started, 1)
    result_file = out / "result.json"
    if proc.returncode != 0 or not result_file.exists():
        return {"ok": False, "wall_s": wall, "failures": [f"the launch exited {proc.returncode}"],
                "stderr_tail": proc.stderr[-3000:]}
    result = json.loads(result_file.read_text())
    result.pop("audit", None)
    found = failures(result)
    return {"ok": not found, "failures": found, "wall_s": wall, **result}


def versions() -> dict:
    import accelerate  # heavy: the libraries whose versions are reported
    import peft
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    nccl = torch.cuda.nccl.version() if cuda else None
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "accelerate": accelerate.__version__, "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one JSON line
        import torch  # heavy: only once the arguments are known

        if not args.cpu_smoke and not torch.cuda.is_available():
            print(f"gpu_check: CUDA is not usable here (torch {torch.__version__}, built for CUDA "
                  f"{torch.version.cuda}). Run it on a GPU host, or pass --cpu-smoke for the CPU variant.")
            return 2
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="asyncgrpo-gpu-check-") as work:
            results = {}
            for backend in args.backends:
                results[backend] = check_backend(backend, args, Path(work))
                print(f"gpu_check: {backend}: {'passed' if results[backend]['ok'] else 'FAILED'} "
                      f"{'; '.join(results[backend]['failures'])}")
    summary = {"check": "gpu_check", "passed": all(r["ok"] for r in results.values()),
               "device": "cpu (gloo)" if args.cpu_smoke else "cuda (nccl)", "model": args.model,
               "dtype": args.dtype, "lora_r": args.lora_r, "gradient_checkpointing": args.gradient_checkpointing,
               "backends": results, "wall_s": round(time.perf_counter() - started, 1), **versions()}
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
