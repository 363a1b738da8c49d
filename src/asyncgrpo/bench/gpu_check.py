"""`scripts/gpu_check.sh`: the trainer's own step on every backend, on one GPU under NCCL; one JSON line per backend.

    scripts/gpu_check.sh                           # DDP, FSDP1, FSDP2, ZeRO-2, ZeRO-3 on Qwen2.5-1.5B's shape, bf16
    scripts/gpu_check.sh --cpu-smoke --backends ddp   # the same launches on CPU: 2 gloo ranks, the toy model

Each backend is one `accelerate launch` of `asyncgrpo.bench.backend_check` with the real `launch/accelerate/*.yaml`
(`--num_processes 1`), in its own session, ended whole at its deadline; its JSON line is appended to
OUT/results.jsonl as soon as it ends, and a summary closes the run (stdout too). Exit codes: EXIT_CODES below.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

BACKENDS = ("ddp", "fsdp1", "fsdp2", "zero2", "zero3")
# What a run checks, in order: the collective helpers on their multi-rank path in a process group of one (NCCL; gloo
# with --cpu-smoke), then each backend's step.
CHECKS = ("collectives", *BACKENDS)
REPO = Path(__file__).resolve().parents[3]
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# The batch per rank: GPU sizes are a real GRPO step's (2 groups x 8 completions of up to 512 tokens).
GPU_BATCH = ["--groups", "2", "--generations", "8", "--prompt_len", "64", "257", "--completion_len", "256", "513"]
CPU_BATCH: list[str] = []  # backend_check's defaults: tiny sequences

# 1 is Python's own for an uncaught exception (a bug in the check) and 2 argparse's for bad arguments (and make's for
# any failing recipe), so the check's verdicts avoid both.
PASSED, CHECK_FAILED, COULD_NOT_START, NO_CUDA = 0, 3, 4, 5
EXIT_CODES = {PASSED: "every backend passed", CHECK_FAILED: "a backend failed its check, its launch or its deadline",
              COULD_NOT_START: "could not start (a JSON line says why)", NO_CUDA: "CUDA is not usable here"}
# What the worker imports from the interpreter's environment (the lent image has them, or the carried wheels do).
NEEDED = ("torch", "transformers", "accelerate", "peft", "safetensors", "yaml", "tqdm", "numpy", "psutil", "requests")
ZERO_NEEDS = ("deepspeed", "pydantic")  # only ZeRO-2/3 launches import them
# Every backend's step A on the same batch from the same start, against DDP's: the relative L2 distance of the updates
# (after - before). fp32: the CPU variant measured 2.7e-5 (FSDP1, FSDP2, ZeRO-2) and 6.8e-5 (ZeRO-3) in Python 3.12
# (docs/gpus.md); the bound leaves 15x of that. bf16: DDP
# and FSDP run the forward under autocast, ZeRO with a bf16 base and fp32 LoRA weights without autocast (DeepSpeed's
# bf16 mode is translated, distributed.py), so their matmuls round differently; Adam moves every weight by about the
# learning rate whatever its gradient, so a weight whose gradient is rounding noise may flip sign. 0.25 of the norm is
# an estimate (1 vs 2 micro-batches, a smaller change, gave ~0.05 on CPU in bf16); the first GPU run's figures are
# recorded whatever they are.
UPDATE_VS_DDP = {"float32": 1e-3, "bfloat16": 0.25}
# Seconds a launch has to stop after SIGTERM (torch's launcher passes it on to its workers) before SIGKILL.
GRACE_S = 20.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0],
                                epilog="exit codes: " + "; ".join(f"{k} {v}" for k, v in EXIT_CODES.items()))
    p.add_argument("--backends", default=",".join(CHECKS), help="comma-separated, of " + ", ".join(CHECKS))
    p.add_argument("--model", default=None, help="default shape:qwen2.5-1.5b (GPU), toy (--cpu-smoke)")
    p.add_argument("--dtype", default=None, help="base weights: default bfloat16 (GPU), float32 (--cpu-smoke)")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="launch the CPU variants (launch/accelerate/<backend>_cpu.yaml, 2 gloo ranks, toy model)")
    p.add_argument("--wheels", "--deepspeed-wheels", dest="wheels", default=str(REPO / "wheels"),
                   help="folder of the wheels the check carries (scripts/gpu_wheels.sh makes it): installed with "
                        "--no-index into a private folder put on the launches' PYTHONPATH when a module they need "
                        "is missing; the interpreter's own packages are never touched")
    p.add_argument("--out", default="gpu-check-out",
                   help="folder for results.jsonl (one JSON line per backend, appended as each ends, then the "
                        "summary) and each launch's log, <backend>.log")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check, start-up included: default 480 (GPU: fits 8 minutes), "
                        "1800 (--cpu-smoke); a backend not reached in time is reported as not run")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per launch (its deadline is also cut to what is left of the budget): default 180 "
                        "(GPU), 900 (--cpu-smoke)")
    args = p.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(CHECKS)
    if unknown:
        p.error(f"unknown backends {sorted(unknown)}: use {', '.join(CHECKS)}")
    args.model = args.model or ("toy" if args.cpu_smoke else "shape:qwen2.5-1.5b")
    args.dtype = args.dtype or ("float32" if args.cpu_smoke else "bfloat16")
    args.budget = args.budget or (1800.0 if args.cpu_smoke else 480.0)
    args.timeout = args.timeout or (900.0 if args.cpu_smoke else 180.0)
    args.out = str(Path(args.out).resolve())  # the launches run from the checkout's root
    return args


# ---- what the launches import -----------------------------------------------------------------------------------
def missing(modules, path: list[str] = ()) -> list[str]:
    """The top-level `modules` that neither this interpreter nor the folders in `path` provide."""
    return [m for m in modules if importlib.util.find_spec(m) is None
            and not any((Path(p) / m).is_dir() or (Path(p) / f"{m}.py").is_file() for p in path)]


def has_pip() -> bool:
    """Whether this interpreter has pip, read from its installed distributions: `find_spec("pip")` would make
    setuptools' distutils shim step aside for the rest of the process (DeepSpeed's setuptools import then fails)."""
    try:
        importlib.metadata.distribution("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def carry_wheels(wheels: Path, target: Path) -> str | None:
    """Installs every wheel in `wheels` into `target` (no index, no dependencies: the folder is the exact set), for
    the launches' PYTHONPATH; None when done, else why not. pip when this interpreter has it, else an unzip (a wheel
    is a zip of what goes into site-packages)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return f"{wheels} holds no wheels (scripts/gpu_wheels.sh makes them; docs/gpus.md: carried wheels)"
    if has_pip():
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                               "--disable-pip-version-check", "--target", str(target), *map(str, found)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return f"installing the wheels of {wheels} into {target} failed: {proc.stderr.strip()[-600:]}"
        return None
    for wheel in found:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    return None


def prepare_environment(args, site: Path) -> tuple[list[str], str | None]:
    """The folders to put on the launches' PYTHONPATH, and why the check cannot start (None: it can)."""
    needed = NEEDED + (ZERO_NEEDS if any(b.startswith("zero") for b in args.backends) else ())
    if not missing(needed):
        return [], None
    why = carry_wheels(Path(args.wheels), site)
    if why is None:
        why = None if not (gone := missing(needed, [str(site)])) else f"{gone} are missing even with the carried wheels"
    if why is None:
        return [str(site)], None
    return [], f"the launches need {missing(needed)}, which this Python ({sys.executable}) lacks, and {why}"


# ---- one launch ---------------------------------------------------------------------------------------------------
def end_whole(proc: subprocess.Popen) -> None:
    """Ends `proc` and everything it started: torch's launcher starts each worker in a session of its own, so
    signalling the launcher's process group alone would leave the workers holding the GPU. SIGTERM first (the
    launcher passes it on), SIGKILL to whatever is left after GRACE_S."""
    import psutil  # accelerate's dependency: on every host that can launch

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    groups = {proc.pid}
    for p in tree:
        with contextlib.suppress(psutil.Error):
            groups.add(os.getpgid(p.pid))
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        _, alive = psutil.wait_procs(tree, timeout=wait_s)
        tree = alive
        if not tree:
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5.0)


def run_launch(cmd: list[str], env: dict, log: Path, deadline_s: float) -> int | None:
    """Runs `cmd` in a session of its own, its output into `log`; its exit code, or None when it was ended whole at
    `deadline_s` (or when this process is stopped meanwhile)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                end_whole(proc)


def launch_command(backend: str, args, out: Path) -> tuple[list[str], dict]:
    """One `accelerate launch` of backend_check for `backend` (its result lands in out/result.json), and its env."""
    from asyncgrpo.inference_node.vllm_server import find_free_port  # after the environment check: it imports requests

    if backend == "collectives":  # one process that makes its own process group of one: no launcher
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env["PYTHONPATH"] = ":".join([str(REPO / "src"), *args.carried, env.get("PYTHONPATH", "")]).rstrip(":")
        cmd = [sys.executable, "-m", "asyncgrpo.bench.collectives_check", "--out", str(out)]
        return cmd + (["--cpu"] if args.cpu_smoke else []), env
    if args.cpu_smoke:
        from asyncgrpo.bench.sync import cpu_launch_env  # heavy: torch, only for the CPU variant's environment

        config, processes, env, batch = f"launch/accelerate/{backend}_cpu.yaml", 2, cpu_launch_env(backend), CPU_BATCH
    else:
        config, processes, batch = f"launch/accelerate/{backend}.yaml", 1, GPU_BATCH
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = ":".join([str(REPO / "src"), *args.carried, env.get("PYTHONPATH", "")]).rstrip(":")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes",
           str(processes), "--main_process_port", str(find_free_port()), "-m", "asyncgrpo.bench.backend_check",
           "--out", str(out), *batch, "--model_name_or_path", args.model, "--torch_dtype", args.dtype,
           "--lora_r", str(args.lora_r), "--lora_alpha", str(2 * args.lora_r), "--lora_target_modules", ALL_LINEAR,
           "--gradient_checkpointing", str(args.gradient_checkpointing).lower()]
    return cmd, env


def check_backend(backend: str, args, work: Path, log: Path, deadline_s: float) -> dict:
    """Launch one backend with `deadline_s` and judge its result: {ok, failures, figures...}."""
    # heavy: the trainer (torch), after the argument checks
    from asyncgrpo.bench import backend_check, collectives_check

    failures = collectives_check.failures if backend == "collectives" else backend_check.failures

    out = work / backend
    out.mkdir()
    cmd, env = launch_command(backend, args, out)
    started = time.perf_counter()
    code = run_launch(cmd, env, log, deadline_s)
    wall = round(time.perf_counter() - started, 1)
    if code is None:
        return {"ok": False, "wall_s": wall, "failures": [f"the launch ran past its deadline of {deadline_s:.0f} s "
                                                          f"and was ended whole (log: {log})"],
                "log_tail": _tail(log)}
    result_file = out / "result.json"
    if code != 0 or not result_file.exists():
        return {"ok": False, "wall_s": wall, "failures": [f"the launch exited {code} (log: {log})"],
                "log_tail": _tail(log)}
    result = json.loads(result_file.read_text())
    result.pop("audit", None)
    result.pop("failures", None)  # judged here, by this checkout's rules
    found = failures(result)
    return {"ok": not found, "failures": found, "wall_s": wall, **result}


def compare_updates(work: Path, done: dict, dtype: str) -> dict | None:
    """Each passing backend's update against DDP's on the same batch (UPDATE_VS_DDP); None when DDP did not pass or
    no other backend did."""
    from safetensors.torch import load_file  # heavy: after the launches

    ran = [b for b in BACKENDS if done.get(b, {}).get("ok") and (work / b / "update.safetensors").is_file()]
    if "ddp" not in ran or len(ran) < 2:
        return None

    def update(backend: str) -> dict:
        after, before = load_file(str(work / backend / "update.safetensors")), load_file(str(work / backend / "before.safetensors"))
        return {k: after[k].double() - before[k].double() for k in after}

    reference = update("ddp")
    norm = sum(float(v.square().sum()) for v in reference.values()) ** 0.5
    bound = UPDATE_VS_DDP["float32" if dtype == "float32" else "bfloat16"]
    rel, found = {}, []
    for backend in ran[1:]:
        mine = update(backend)
        if set(mine) != set(reference):
            found.append(f"{backend}'s adapter has other tensors than DDP's: {sorted(set(mine) ^ set(reference))[:3]}")
            continue
        rel[backend] = sum(float((mine[k] - reference[k]).square().sum()) for k in reference) ** 0.5 / norm
        if not rel[backend] <= bound:
            found.append(f"{backend}'s update differs from DDP's by {rel[backend]:.3g} of its norm, more than {bound}")
    return {"ok": not found, "failures": found, "reference": "ddp", "update_rel_diff_vs_ddp": rel, "bound": bound}


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_bytes()[-chars:].decode(errors="replace")


# ---- the run ------------------------------------------------------------------------------------------------------
class Results:
    """OUT/results.jsonl: each line appended and flushed to disk the moment it is known, so a run stopped from
    outside keeps every backend that had ended."""

    def __init__(self, out: Path, run: str):
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.run = out / "results.jsonl", run

    def add(self, line: dict) -> dict:
        line = {"check": "gpu_check", "run": self.run, **line}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return line


def versions() -> dict:
    # heavy: the libraries whose versions are reported
    import accelerate
    import peft
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    nccl = torch.cuda.nccl.version() if cuda else None
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "accelerate": accelerate.__version__, "python": sys.version.split()[0]}


def _stopped(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through run_launch's `finally`: the launch is ended whole


def run_backends(args, results: Results, work: Path, started: float) -> dict:
    """Each backend in turn, each under min(--timeout, what is left of --budget); its line appended as it ends."""
    done = {}
    for backend in args.backends:
        left = args.budget - (time.monotonic() - started)
        if left < 10:
            done[backend] = {"ok": False, "not_run": True,
                             "failures": [f"not run: the budget of {args.budget:.0f} s was spent"]}
        else:
            deadline = min(args.timeout, left)
            try:
                done[backend] = check_backend(backend, args, work, Path(args.out) / f"{backend}.log", deadline)
            except Exception as e:  # noqa: BLE001 - one backend's broken result must not lose the others
                done[backend] = {"ok": False, "failures": [f"judging the launch raised {type(e).__name__}: {e}"]}
            done[backend]["deadline_s"] = round(deadline)
        results.add({"backend": backend, **done[backend]})
        print(f"gpu_check: {backend}: {'passed' if done[backend]['ok'] else 'FAILED'} "
              f"{'; '.join(done[backend]['failures'])}")
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    results = Results(Path(args.out), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    header = {"device": "cpu (gloo)" if args.cpu_smoke else "cuda (nccl)", "model": args.model, "dtype": args.dtype,
              "lora_r": args.lora_r, "gradient_checkpointing": args.gradient_checkpointing,
              "budget_s": args.budget, "results_file": str(results.path)}

    previous = signal.signal(signal.SIGTERM, _stopped)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the verdict's JSON line alone
            code, line = _run(args, results, started)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(results.add({**header, "exit_code": code, "verdict": EXIT_CODES[code], **line})))
    return code


def _run(args, results: Results, started: float) -> tuple[int, dict]:
    """(exit code, what the verdict line adds) of a whole run."""
    with tempfile.TemporaryDirectory(prefix="asyncgrpo-gpu-check-") as work:
        try:
            args.carried, why = prepare_environment(args, Path(work) / "site")
            if why is None:
                sys.path[:0] = args.carried
                import torch  # heavy: only once the environment is known to have it

                # The worker's imports, here first: a module they need and lack would fail every launch.
                import asyncgrpo.bench.backend_check  # noqa: F401

                if not args.cpu_smoke and not torch.cuda.is_available():
                    print(f"gpu_check: CUDA is not usable here (torch {torch.__version__}, built for CUDA "
                          f"{torch.version.cuda}). Run it on a GPU host, or pass --cpu-smoke for the CPU variant.")
                    return NO_CUDA, {"started": False, "why": "CUDA is not usable here", **versions()}
        except Exception as e:  # noqa: BLE001 - whatever stops the start is reported as such, with its reason
            why = f"{type(e).__name__}: {e}"
        if why is not None:
            print(f"gpu_check: could not start: {why}")
            return COULD_NOT_START, {"started": False, "why": why}
        done = run_backends(args, results, Path(work), started)
        try:
            compared = compare_updates(Path(work), done, args.dtype)
        except Exception as e:  # noqa: BLE001 - the backends' own lines are kept whatever happens here
            compared = {"ok": False, "failures": [f"comparing the updates raised {type(e).__name__}: {e}"]}
        if compared is not None:
            done["cross_backend"] = compared
            results.add({"backend": "cross_backend", **compared})
            print(f"gpu_check: cross_backend: {'passed' if compared['ok'] else 'FAILED'} "
                  f"{'; '.join(compared['failures'])}")
    passed = all(r["ok"] for r in done.values())
    return (PASSED if passed else CHECK_FAILED), {"started": True, "passed": passed, "backends": done,
                                                  "wall_s": round(time.monotonic() - started, 1), **versions()}

if __name__ == "__main__":
    sys.exit(main())
