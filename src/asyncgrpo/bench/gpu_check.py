"""`scripts/gpu_check.sh`: one GPU, a few minutes, no vLLM and no DeepSpeed: does the trainer's GPU path hold up?

    scripts/gpu_check.sh                 # Qwen2.5-1.5B-shaped model, random bf16 weights, on cuda:0, NCCL
    scripts/gpu_check.sh --cpu-smoke     # the same code path, tiny sizes, on CPU with gloo (what the unit test runs)

A one-rank process group, an FSDP2-wrapped LoRA model, device checks of the collectives asyncgrpo makes, then a few
train steps; one JSON line out. Exit status 0: passed, 1: a check failed, 2: no CUDA. The details: docs/gpus.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import socket
import statistics
import sys
import time

import accelerate
import peft
import torch
import torch.distributed as dist
import transformers
from accelerate.utils import DistributedType
from peft import LoraConfig, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config

from asyncgrpo import distributed
from asyncgrpo.distributed import dist_max, dist_sum
from asyncgrpo.trainer.batching import to_device
from asyncgrpo.trainer.gather import gather_lora_state, lora_parameters
from asyncgrpo.trainer.logprobs import find_scoring_head, sequence_logprobs
from asyncgrpo.trainer.loss import LossSpec, group_advantages, grpo_loss

# Sizes: the default is the Qwen2.5-1.5B shape; --cpu-smoke takes the tiny one unless a flag says otherwise.
QWEN25_1P5B = dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
                   groups=8, generations=8, prompt_len=128, completion_len=256, micro_batch=16, steps=5)
TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512,
            groups=2, generations=4, prompt_len=8, completion_len=8, micro_batch=4, steps=3)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# torch.distributed functions that take tensors; asyncgrpo's calls to any of them are recorded.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "gather", "broadcast", "reduce",
               "reduce_scatter_tensor", "scatter", "all_to_all_single")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run on CPU with gloo, tiny sizes by default (for tests on machines without a GPU)")
    for name, default in QWEN25_1P5B.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {default} ({TINY[name]} with --cpu-smoke)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="dtype of the base weights")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sizes = TINY if args.cpu_smoke else QWEN25_1P5B
    for name, default in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


# ---- recording the devices of collective inputs -----------------------------------------------------------

def _tensors_in(values) -> list:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, torch.Tensor))
    return found


@contextlib.contextmanager
def record_collectives(records: list[dict]):
    """Within the block, each call that a module of the asyncgrpo package (this one excepted) makes to a
    torch.distributed collective appends {op, caller, devices} to `records`, then runs the collective."""
    def recording(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("asyncgrpo.") and caller != __name__:
                devices = sorted({str(t.device) for t in _tensors_in([*args, *kwargs.values()])})
                records.append({"op": name, "caller": caller, "devices": devices})
            return fn(*args, **kwargs)
        return wrapper

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, recording(name, fn))
    try:
        yield records
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def device_check(name: str, expected: str, body) -> dict:
    """Run `body()` with collectives recorded. Passes when it raises nothing, returns no failure reason (a string),
    at least one collective was seen, and every tensor they got lies on `expected`."""
    records: list[dict] = []
    error = None
    try:
        with record_collectives(records):
            reason = body()
        error = reason if isinstance(reason, str) else None
    except Exception as exc:  # noqa: BLE001 - the check reports what went wrong and the run goes on
        error = f"{type(exc).__name__}: {exc}"
    off_device = [r for r in records if any(d != expected for d in r["devices"])]
    if error is None and not records:
        error = "no collective was recorded: nothing was checked"
    if error is None and off_device:
        error = f"tensors not on {expected}: " + "; ".join(f"{r['caller']}.{r['op']} got {r['devices']}"
                                                        for r in off_device[:4])
    seen = sorted({f"{r['caller']}.{r['op']}:{','.join(r['devices'])}" for r in records})
    return {"name": name, "ok": error is None, "expected_device": expected, "collectives": len(records),
            "seen": seen, "error": error}


# ---- process group, model, batches ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_one_rank_group(device):
    """A process group of one rank on `device`: NCCL for CUDA, gloo for CPU."""
    # A TCP rendezvous rather than MASTER_ADDR/RANK/WORLD_SIZE: nothing is left in os.environ for code run after it
    # in the same process (an Accelerator would take those variables for a launch).
    init = f"tcp://127.0.0.1:{_free_port()}"
    timeout = datetime.timedelta(seconds=120)  # a collective that hangs fails the check instead of the machine's time
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1, timeout=timeout)


class OneProcess:
    """What the gather functions read from an Accelerator, for one process that wrapped its model itself."""

    def __init__(self, device):
        self.device = device
        self.distributed_type = DistributedType.FSDP
        self.is_fsdp2 = True
        self.num_processes, self.process_index, self.is_main_process = 1, 0, True

    def unwrap_model(self, model):
        return model


def build_model(args, device):
    """Random-init Qwen2 of the requested shape on `device`, LoRA on every projection, FSDP2 per decoder layer and
    on the root."""
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    if args.gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM", bias="none")
    model = get_peft_model(base, lora)  # LoRA weights in fp32 over the bf16 base (PEFT's default)
    model.train()
    mesh = init_device_mesh(device.type, (1,))
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, config


def synthetic_micro_batches(args, vocab: int) -> list[dict]:
    """CPU tensors in the layout the trainer collates (trainer._collate): position t of behaviour/mask scores token
    t+1; completions of random length in [completion_len/2, completion_len], right-padded."""
    g = torch.Generator().manual_seed(args.seed)
    n_seq, length = args.groups * args.generations, args.prompt_len + args.completion_len
    input_ids = torch.randint(0, vocab, (n_seq, length), generator=g)
    lengths = torch.randint(max(1, args.completion_len // 2), args.completion_len + 1, (n_seq,), generator=g)
    attention = torch.zeros(n_seq, length, dtype=torch.long)
    mask = torch.zeros(n_seq, length - 1)
    for i, n in enumerate(lengths.tolist()):
        attention[i, :args.prompt_len + n] = 1
        mask[i, args.prompt_len - 1:args.prompt_len - 1 + n] = 1.0
    rewards = torch.randint(0, 2, (args.groups, args.generations), generator=g).float()
    advantages = group_advantages(rewards).reshape(-1)
    per = args.micro_batch
    return [{"input_ids": input_ids[i:i + per], "attention_mask": attention[i:i + per], "mask": mask[i:i + per],
             "advantages": advantages[i:i + per]} for i in range(0, n_seq, per)]


def policy_logprobs(model, batch: dict, *, naive: bool = False):
    """The trainer's own scoring path (logprobs.sequence_logprobs: the LM head on completion positions only, in
    chunks, no (B, T, V) fp32 tensor); `naive=True` takes full logits instead, for the comparison."""
    head = None if naive else find_scoring_head(model)
    return sequence_logprobs(model, head, batch["input_ids"], batch["attention_mask"], batch["mask"], 1.0)


# ---- the run ----------------------------------------------------------------------------------------------

def train_steps(args, model, optimizer, micro_batches, device, use_dist_sum: bool = True) -> dict:
    """`args.steps` optimizer steps the way the trainer takes one; returns timings and the on-policy ratio."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():  # the behaviour policy: the model itself before the first step
        for b in micro_batches:
            b["behaviour"] = policy_logprobs(model, to_device(b, device)).to("cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    times, first_ratio, losses = [], None, []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        local = sum(float(b["mask"].sum()) for b in micro_batches)
        n_tokens = dist_sum(local) if use_dist_sum else local  # one rank: the same number either way
        max_ratio, loss_sum = 0.0, 0.0
        for i, b in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # FSDP2's no_sync: reduce once
            batch = to_device(b, device)
            terms = grpo_loss(policy_logprobs(model, batch), batch["behaviour"], batch["advantages"], batch["mask"],
                              LossSpec(epsilon_low=0.2, epsilon_high=0.28), normaliser=n_tokens)
            terms.loss.backward()
            max_ratio = max(max_ratio, float(terms.max_abs_log_ratio))
            loss_sum += float(terms.loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss_sum)
        first_ratio = max_ratio if first_ratio is None else first_ratio
    return {"step_times_s": [round(t, 4) for t in times], "losses": losses, "on_policy_max_abs_log_ratio": first_ratio,
            "step_time_s": statistics.median(times[1:]) if len(times) > 1 else times[0]}


def check_gather(model, device) -> str | None:
    """The LoRA gather returns every adapter tensor, on CPU, equal to the (full) parameter."""
    stats: dict = {}
    state = gather_lora_state(OneProcess(device), model, stats)
    named = lora_parameters(model)
    if state is None or len(state) != len(named):
        return f"gathered {0 if state is None else len(state)} tensors, the adapter has {len(named)}"
    marker = f".{model.active_adapter}."
    for name, param in named:
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        got = state.get(name.replace(marker, ".", 1))
        if got is None or got.device.type != "cpu" or not torch.equal(got, full.detach().cpu()):
            return f"{name}: gathered tensor missing, not on CPU or different from the parameter"
    return None


def collective_path_forced():
    """dist_sum/dist_max skip the collective with one rank; the check forces the path every multi-rank job takes."""
    return _patched(distributed, "is_distributed", lambda: True)


@contextlib.contextmanager
def _patched(obj, name, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def run(args) -> dict:
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    init_one_rank_group(device)
    expected = "cuda:0" if device.type == "cuda" else "cpu"
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model, config = build_model(args, device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

        def summed():
            with collective_path_forced():
                got = dist_sum(3.5)
            return None if got == 3.5 else f"dist_sum(3.5) on one rank returned {got}"

        def maxed():
            with collective_path_forced():
                got = dist_max(-2.0)
            return None if got == -2.0 else f"dist_max(-2.0) on one rank returned {got}"

        checks = [device_check("dist_sum", expected, summed), device_check("dist_max", expected, maxed),
                  device_check("gather_fsdp2", expected, lambda: check_gather(model, device))]
        micro_batches = synthetic_micro_batches(args, config.vocab_size)
        result: dict = {}

        def steps():
            with collective_path_forced():
                result.update(train_steps(args, model, optimizer, micro_batches, device))

        checks.append(device_check("train_steps", expected, steps))
        if not result:  # the steps failed (e.g. dist_sum on NCCL): measure them without the project's collectives
            result = train_steps(args, model, optimizer, micro_batches, device, use_dist_sum=False)
        checks.append(device_check("gather_fsdp2_after_training", expected, lambda: check_gather(model, device)))
        chunked_vs_naive = compare_chunked_naive(model, micro_batches[0], device)
        n_params = sum(p.numel() for p in model.parameters())
        n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tokens = sum(int(b["attention_mask"].sum()) for b in micro_batches)
        return {
            "check": "gpu_check", "device": expected, "backend": dist.get_backend(),
            "device_checks_passed": all(c["ok"] for c in checks), "device_checks": checks,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
            if device.type == "cuda" else None,
            "step_time_s": round(result["step_time_s"], 4), "step_times_s": result["step_times_s"],
            "tokens_per_step": tokens, "tokens_per_s": round(tokens / result["step_time_s"], 1),
            "on_policy_max_abs_log_ratio": result["on_policy_max_abs_log_ratio"],
            "chunked_vs_naive_max_abs_logprob_diff": chunked_vs_naive,
            "losses": result["losses"],
            "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                      "intermediate": args.intermediate, "vocab": args.vocab, "dtype": args.dtype,
                      "params": n_params, "lora_params": n_lora, "lora_r": args.lora_r,
                      "gradient_checkpointing": args.gradient_checkpointing},
            "batch": {"groups": args.groups, "generations": args.generations, "prompt_len": args.prompt_len,
                      "completion_len": args.completion_len, "micro_batch": args.micro_batch, "steps": args.steps},
            **versions(device),
        }
    finally:
        dist.destroy_process_group()


def compare_chunked_naive(model, batch: dict, device) -> float:
    """Max |chunked - naive| logprob over one micro-batch's completion tokens (bf16 base: both read the same
    bf16 hidden states; the head's matmul differs only in how the chunks are cut)."""
    moved = to_device(batch, device)
    with torch.no_grad():
        chunked = policy_logprobs(model, moved)
        naive = policy_logprobs(model, moved, naive=True)
    return round(float(((chunked - naive).abs() * moved["mask"]).max()), 6)


def versions(device) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    nccl = torch.cuda.nccl.version() if device.type == "cuda" else None  # (major, minor, patch)
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    return {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "transformers": transformers.__version__, "peft": peft.__version__, "accelerate": accelerate.__version__,
            "python": sys.version.split()[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not usable here (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda}, {torch.cuda.device_count()} devices visible). Run it on a GPU host, or pass "
              f"--cpu-smoke for the tiny CPU version.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the one JSON line
        result = run(args)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    return 0 if result["device_checks_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
