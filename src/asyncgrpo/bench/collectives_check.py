"""The project's collective helpers on their multi-rank path in a process group of ONE rank (gpu_check's first launch).

    python -m asyncgrpo.bench.collectives_check --out DIR          # NCCL on this host's GPU 0
    python -m asyncgrpo.bench.collectives_check --out DIR --cpu    # gloo: the CPU twin that `make test` runs

With one rank the helpers of `asyncgrpo.distributed` return early (`is_distributed()` is False), so a one-GPU launch
never hands them a tensor; `multi_rank_path()` makes them take the path they take with several ranks. Writes
DIR/result.json; `failures(result)` names what it fails (docs/gpus.md: the one-GPU check).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from asyncgrpo import distributed
from asyncgrpo.contracts import Group

# Sums and maxima travel as float64: 1e16 + 1 and 0.1 survive exactly there, not in float32.
REDUCED = [0.1, 1e16 + 2.0, -3.25]


class _Recorder:
    """torch.distributed as the helpers see it inside `multi_rank_path()`: every call is recorded (its name, and the
    devices of the tensors handed to it) and then made."""

    def __init__(self, module):
        self._module, self.calls, self.devices = module, [], set()

    def __getattr__(self, name):
        target = getattr(self._module, name)
        if not callable(target) or name.startswith(("is_", "get_")) or isinstance(target, type):
            return target

        def call(*args, **kwargs):
            self.calls.append(name)
            for value in [*args, *kwargs.values()]:
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(t, torch.Tensor):
                        self.devices.add(str(t.device))
            return target(*args, **kwargs)

        return call


@contextlib.contextmanager
def multi_rank_path():
    """Within it, the helpers of `asyncgrpo.distributed` see a process group of any size as distributed, and take
    the collective path (scatter_object_list, broadcast, all_gather_object, all_reduce) instead of returning early;
    yields the recorder of every torch.distributed call they and trainer.gather make."""
    from asyncgrpo.trainer import gather  # heavy: the trainer's gather (accelerate), this check only

    recorder = _Recorder(dist)
    saved = distributed.is_distributed, distributed.dist, gather.dist
    distributed.is_distributed = lambda: dist.is_available() and dist.is_initialized()
    distributed.dist = gather.dist = recorder
    try:
        yield recorder
    finally:
        distributed.is_distributed, distributed.dist, gather.dist = saved


def init_one_rank(backend: str, init_file: Path) -> torch.device:
    """A process group of one rank on `backend`; returns the device its tensors live on (GPU 0 under NCCL)."""
    init_file.unlink(missing_ok=True)  # file:// rendezvous: a file left by an earlier run would be read as this one's
    if backend == "nccl":
        torch.cuda.set_device(0)  # scatter_object_list's tensors go to the current CUDA device
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    return distributed.collective_device()


def _group(index: int) -> Group:
    return Group(prompt="p", prompt_ids=[5, 6, 7][:1 + index], completion_ids=[[1, 2, 3, 4][:2 + index]] * 2,
                 behaviour_logprobs=[[-0.5] * (2 + index)] * 2, rewards=[1.0, 0.0], reward_parts={},
                 advantages=[0.5, -0.5], version=3, adapter="a", index=index)


def check_objects() -> dict:
    """scatter (a batch share of Groups of uneven lengths), broadcast, all_gather, on_main: each must come back equal;
    the scattered share as a copy (the early return hands back the very object, the collective a deserialised one)."""
    share = [_group(0), _group(1), _group(2)]
    scattered = distributed.scatter_object([share])
    payload = {"ids": torch.arange(7), "text": "x" * 1000}
    broadcast = distributed.broadcast_object(payload)
    gathered = distributed.all_gather_object(("rank", 0))
    main_result = distributed.on_main(lambda: 41 + 1, "the check")
    try:
        distributed.on_main(lambda: (_ for _ in ()).throw(ValueError("raised on purpose")), "the check")
        raised = None
    except ValueError as exc:
        raised = str(exc)
    return {
        "scatter_equal": [asdict(g) for g in scattered] == [asdict(g) for g in share] if isinstance(scattered, list)
        else False,
        "scatter_copied": scattered is not share,
        "broadcast_equal": isinstance(broadcast, dict) and torch.equal(broadcast["ids"], payload["ids"])
        and broadcast["text"] == payload["text"],
        "all_gather": [list(x) for x in gathered] if isinstance(gathered, list) else repr(gathered),
        "on_main_result": main_result, "on_main_reraised": raised,
    }


def check_reductions() -> dict:
    """The scalar reductions: one all-reduce each, float64, on the collective device."""
    return {"sums": distributed.dist_sums(REDUCED), "maxima": distributed.dist_maxima(REDUCED),
            "sum": distributed.dist_sum(2.5), "max": distributed.dist_max(-1.5)}


def check_shared_dir(out: Path) -> dict:
    """require_shared_dir: the probe file rank 0 writes is seen, and removed."""
    path = out / "shared"
    distributed.require_shared_dir(path, "output_dir")
    return {"shared_dir_probes_left": sorted(p.name for p in path.iterdir())}


def check_lora_gather(device: torch.device) -> dict:
    """trainer.gather's FSDP2 gather on a one-rank mesh: a PEFT model whose LoRA tensors have uneven lengths (rank 3:
    lora_A 3x10, lora_B 7x3, another layer 3x7 and 5x3) sharded with `fully_shard`; what rank 0 gets must be every
    tensor exactly, under PEFT's key names, and the bytes moved the adapter's."""
    from peft import LoraConfig, get_peft_model  # heavy: peft, this check only
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncgrpo.trainer.gather import gather_fsdp2, lora_parameters

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    model = get_peft_model(base, LoraConfig(r=3, lora_alpha=6, target_modules=["0", "2"])).to(device)
    for _, p in lora_parameters(model):
        with torch.no_grad():
            p.copy_(torch.randn_like(p))  # lora_B starts at zero: give every tensor distinct values
    expected = {n.replace(".default.", "."): p.detach().to("cpu", copy=True) for n, p in lora_parameters(model)}
    fully_shard(model, mesh=init_device_mesh(device.type, (1,)))
    acc = _OneRank()
    state, moved = gather_fsdp2(acc, model)
    state = state or {}
    return {
        "gather_keys_match": sorted(state) == sorted(expected),
        "gather_max_abs_diff": max((float((state[k] - v).abs().max()) for k, v in expected.items() if k in state),
                                   default=float("inf")),
        "gather_shapes": {k: list(v.shape) for k, v in sorted(state.items())},
        "gathered_bytes": moved, "adapter_bytes": sum(v.numel() * v.element_size() for v in expected.values()),
    }


class _OneRank:
    """What trainer.gather reads of accelerate's Accelerator, for a process group of one."""

    num_processes, process_index, is_main_process = 1, 0, True

    @staticmethod
    def unwrap_model(model):
        return model


def check_rng(out: Path, device: torch.device) -> dict:
    """This rank's RNG states saved as a checkpoint saves them (rng_state) and restored with restore_rng: the numbers
    drawn after the restore are the ones drawn after the save, on the CPU and on this rank's CUDA device."""
    from asyncgrpo.files import sha256_file
    from asyncgrpo.trainer.checkpoint import FORMAT_VERSION, MANIFEST, TrainerState, restore_rng, rng_state

    path = out / "rng-checkpoint"
    path.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / "rng-rank0.pt")
    files = {"rng-rank0.pt": {"bytes": (path / "rng-rank0.pt").stat().st_size,
                              "sha256": sha256_file(path / "rng-rank0.pt")}}
    state = asdict(TrainerState(step=1, version=1, data_position=0, run_id="collectives-check"))
    (path / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION, "state": state, "files": files}))

    def draw() -> list[float]:
        values = torch.rand(3).tolist()
        if device.type == "cuda":
            values += torch.rand(3, device=device).tolist()
        return values

    first = draw()
    second = draw()  # the generators moved on
    restore_rng(path, 0)
    again = draw()
    return {"rng_cuda": device.type == "cuda", "rng_restored": again == first, "rng_moved_on": second != first}


def run_checks(out: Path, device: torch.device) -> dict:
    """Every check, inside `multi_rank_path()`; a check that raises is recorded with its error, the others still run."""
    result: dict = {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "device": str(device)}
    with multi_rank_path() as recorder:
        for name, check in (("objects", check_objects), ("reductions", check_reductions),
                            ("shared_dir", lambda: check_shared_dir(out)), ("lora_gather", lambda: check_lora_gather(device)),
                            ("rng", lambda: check_rng(out, device))):
            try:
                result[name] = check()
            except Exception as exc:  # noqa: BLE001 - reported by failures(), the other checks still run
                result[name] = {"error": f"{type(exc).__name__}: {exc}"}
    result["collectives_called"] = sorted(set(recorder.calls))
    result["collective_tensor_devices"] = sorted(recorder.devices)
    return result


# What the helpers must have called on their multi-rank path (none of it runs on the early-return path).
EXPECTED_CALLS = {"scatter_object_list", "broadcast_object_list", "all_gather_object", "all_reduce", "all_gather"}


def failures(result: dict) -> list[str]:
    """What `result` fails, one line each (empty: it passes)."""
    found = [f"{name} raised {part['error']}" for name, part in result.items()
             if isinstance(part, dict) and "error" in part]
    not_called = EXPECTED_CALLS - set(result.get("collectives_called", []))
    if not_called:
        found.append(f"never called {sorted(not_called)}: the helpers did not take their multi-rank path")
    if result.get("collective_tensor_devices", [result.get("device")]) != [result.get("device")]:
        found.append(f"tensors handed to collectives lay on {result['collective_tensor_devices']}, want only "
                     f"{result.get('device')} (NCCL takes none on the CPU)")
    objects, reduced = result.get("objects", {}), result.get("reductions", {})
    lora, rng = result.get("lora_gather", {}), result.get("rng", {})
    if "error" not in objects:
        for key in ("scatter_equal", "scatter_copied", "broadcast_equal"):
            if objects.get(key) is not True:
                found.append(f"{key} is {objects.get(key)!r}: the object did not travel through the collective intact")
        if objects.get("all_gather") != [["rank", 0]]:
            found.append(f"all_gather_object gave {objects.get('all_gather')!r}, want [['rank', 0]]")
        if objects.get("on_main_result") != 42 or objects.get("on_main_reraised") != "raised on purpose":
            found.append(f"on_main gave {objects.get('on_main_result')!r} and re-raised "
                         f"{objects.get('on_main_reraised')!r}, want 42 and 'raised on purpose'")
    if "error" not in reduced:
        want = {"sums": REDUCED, "maxima": REDUCED, "sum": 2.5, "max": -1.5}
        for key, value in want.items():
            if reduced.get(key) != value:
                found.append(f"{key}: {reduced.get(key)!r}, want {value!r} exactly (float64 all-reduce)")
    if result.get("shared_dir", {}).get("shared_dir_probes_left"):
        found.append(f"require_shared_dir left {result['shared_dir']['shared_dir_probes_left']}")
    if "error" not in lora:
        if lora.get("gather_keys_match") is not True or not lora.get("gather_max_abs_diff", 1.0) == 0.0:
            found.append(f"the FSDP2 LoRA gather: keys match {lora.get('gather_keys_match')}, largest difference "
                         f"{lora.get('gather_max_abs_diff')}; want every tensor exactly")
        if lora.get("gathered_bytes") != lora.get("adapter_bytes"):
            found.append(f"the FSDP2 LoRA gather moved {lora.get('gathered_bytes')} bytes for a "
                         f"{lora.get('adapter_bytes')}-byte adapter")
    if "error" not in rng and not (rng.get("rng_restored") is True and rng.get("rng_moved_on") is True):
        found.append(f"RNG save/restore: restored {rng.get('rng_restored')}, moved on {rng.get('rng_moved_on')}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.bench.collectives_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU instead of NCCL on GPU 0")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = init_one_rank("gloo" if args.cpu else "nccl", out / "init")
    try:
        result = run_checks(out, device)
    finally:
        dist.destroy_process_group()
    result["failures"] = failures(result)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
