"""`asyncgrpo bench sync --backend {ddp,fsdp1,fsdp2,zero2,zero3,all} [--servers N] --json`: what one weight sync costs.

The parent builds a bench model whose base dwarfs its adapter, starts vLLM CPU servers on it unless `--server` is
given, and launches two CPU ranks of this module's worker under `accelerate launch`. Each round, the worker times
gather -> write -> publish in both sync modes against a naive full-state gather, then compares the served logprobs
with the trainer's. What each output figure means: docs/benchmarks.md ("`bench sync`").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.children import run_group
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import toy_world
from asyncgrpo.demo import default_config_path
from asyncgrpo.errors import AsyncGRPOError, ConfigError
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port, served_lora_rank
from asyncgrpo.toy.shapes import shape_model_dir

# The environment each backend needs on a CPU host (docs/cpu-hosts.md): accelerate needs ACCELERATE_USE_CPU for
# DDP/FSDP but must not see it for DeepSpeed, which needs DS_ACCELERATOR=cpu instead.
BACKEND_ENV = {"ddp": {"ACCELERATE_USE_CPU": "true"},
               "fsdp1": {"ACCELERATE_USE_CPU": "true", "ACCELERATE_TORCH_DEVICE": "cpu"},
               "fsdp2": {"ACCELERATE_USE_CPU": "true"},
               "zero2": {"DS_ACCELERATOR": "cpu"},
               "zero3": {"DS_ACCELERATOR": "cpu"}}
BACKENDS = tuple(BACKEND_ENV)


def cpu_launch_env(backend: str | None = None, large_model: bool = False) -> dict[str, str]:
    """This process's environment for a launch on CPU: `backend`'s variables (None: a plain process) and none of
    the other backends' switches, offline, one OpenMP thread per process. `large_model`: glibc hands freed tensors
    of 1 MiB and more back to the system (docs/cpu-hosts.md: without it a rank keeps its load buffers)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "DS_ACCELERATOR")}
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(BACKEND_ENV[backend] if backend else {})})
    if large_model:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**20))
    return env
LORA_TARGETS = "[q_proj,k_proj,v_proj,o_proj]"
ROUNDS = 4  # per sync mode; the first is warm-up


# ---- the bench model ---------------------------------------------------------------------------------------

def bench_model_dir(cache: Path, tokenizer_dir: str) -> Path:
    """A random-init Qwen2 (hidden 512, 4 layers) with the toy tokenizer, built once under `cache`."""
    # heavy: torch and transformers, only to build the bench model once (then cached)
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    target = cache / "bench-sync-h512-l4"
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    partial = Path(tempfile.mkdtemp(prefix=".bench-sync-", dir=cache))
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, target)  # atomic: a half-built model is never found
    return target


# ---- the parent: server + launch ---------------------------------------------------------------------------

def launch_worker(backend: str, model_dir: Path, server_url: str, out: Path, overrides: list[str],
                  timeout_s: float = 1800, large_model: bool = False) -> dict:
    """Two CPU ranks of the worker under `accelerate launch` with the backend's config; returns its JSON."""
    repo = Path(__file__).resolve().parents[3]
    out.parent.mkdir(parents=True, exist_ok=True)
    env = cpu_launch_env(backend, large_model=large_model)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(repo / "launch" / "accelerate" / f"{backend}_cpu.yaml"), "--main_process_port", str(find_free_port()),
           "-m", "asyncgrpo.bench.sync", "--worker", "--out", str(out),
           "--model_name_or_path", str(model_dir), "--vllm_server_base_url", server_url,
           "--lora_adapter_path", str(out.parent / "adapters"), "--lora_target_modules", LORA_TARGETS, *overrides]
    proc = run_group(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or not out.exists():

        raise AsyncGRPOError(f"bench sync worker for {backend} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def run(backend: str, server_url: str | None, overrides: list[str], model: str | None = None,
        sync_mode: str = "pause", servers: int = 1, naive: bool = True) -> dict:
    """Build the bench model, start `servers` vLLM servers on it unless `server_url` (one URL, or several joined by
    commas) is given, run the worker for `backend` (or for each backend, one after another against the same
    servers, with `all`). `sync_mode`: whose figures go at the top level of the JSON (both modes are measured).
    `naive` False: no whole-model gather to compare with (it holds a second copy of the base on rank 0)."""
    # heavy: the toy world's module imports torch (tests import cpu_launch_env from here)
    from asyncgrpo.toy.world import default_cache_dir

    backends = BACKENDS if backend == "all" else (backend,)
    if not set(backends) <= set(BACKENDS):
        raise ConfigError("--backend", f"{backend!r} is not one of {', '.join(BACKENDS)} or all", "pick one of those")
    if servers < 1:
        raise ConfigError("--servers", f"{servers} is not a number of servers", "give 1 or more")
    cfg = AsyncGRPOConfig.load(default_config_path(), overrides)  # the trainer's dtype and rank: the server's too
    world = toy_world(cfg)
    cache = Path(os.environ.get("ASYNCGRPO_CACHE") or default_cache_dir())
    if model and model.startswith("shape:"):
        model = shape_model_dir(model, cfg.torch_dtype, cache)
    model_dir = Path(model) if model else bench_model_dir(cache, str(world.model_dir))
    results = {}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncgrpo-bench-sync-")))
        if server_url is None:
            server_url = ",".join(_start_servers(stack, servers, model_dir, work, dtype=cfg.torch_dtype,
                                                 max_lora_rank=served_lora_rank(cfg.lora_r)))
        for name in backends:
            result = launch_worker(name, model_dir, server_url, work / name / "result.json",
                                   [*overrides, *([] if naive else ["--skip_naive"])], large_model=model is not None)
            results[name] = {"backend": name, "sync_mode": sync_mode, **result["modes"][sync_mode],
                             **{k: v for k, v in result.items() if k != "modes"}, "modes": result["modes"]}
    if backend != "all":
        return {**results[backend], "load_average": os.getloadavg()}
    return {"backends": results, "load_average": os.getloadavg()}


def _start_servers(stack, n: int, model_dir: Path, work: Path, *, dtype: str, max_lora_rank: int) -> list[str]:
    """Start `n` small vLLM CPU servers on free ports (1 GiB of KV cache each; ~2.5 GiB of memory on the bench
    model), all at once, serving in the trainer's dtype; stopped when `stack` closes; returns their URLs once every
    one answers /health."""
    started = []
    for i in range(n):
        server = VLLMServer(model_dir, find_free_port(), max_lora_rank=max_lora_rank, max_loras=4, max_model_len=256,
                            dtype=dtype, kv_cache_gib=1, log_path=work / f"vllm-{i}.log")
        stack.callback(server.stop)
        server.start()
        started.append(server)
    weights_gib = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**30
    for server in started:
        # Start-up is CPU-bound: n servers on a few cores take n times longer, and a real-shape model adds its load
        # and warm-up (Qwen2.5-1.5B's 2.9 GiB in bf16: ~2.5 min on 2 busy cores).
        server.wait_ready(timeout_s=300.0 * n * max(1.0, weights_gib))
    return [server.base_url for server in started]


# ---- the worker: every rank ------------------------------------------------------------------------------

@dataclass
class Rig:
    """What the worker measures with: the trainer's policy (`build_policy`) on every rank; on rank 0 also the
    servers' clients and an adapter store, and the version last written."""

    cfg: object
    acc: object
    policy: object  # policy.Policy
    model_path: str
    clients: list = field(default_factory=list)
    store: object = None
    prefix: str = ""
    version: int = 0

    @property
    def main(self) -> bool:
        return self.acc.is_main_process


def _naive_gather(backend: str, acc, model) -> tuple[dict | None, int]:
    """Collective: what a trainer without a LoRA-only path does: gather the whole state dict to rank 0 (every base
    weight included), then keep the LoRA keys. Returns ({parameter name: tensor} on rank 0, bytes gathered)."""
    # heavy: torch and the trainer's modules, needed by the worker ranks only (tests import cpu_launch_env from here)
    import torch

    full: dict | None
    if backend == "fsdp2":
        # heavy: torch's distributed state-dict API, for this backend's naive gather only
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif backend == "fsdp1":
        # heavy: FSDP1's state-dict types, for this backend's naive gather only
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # rank0_only/offload_to_cpu would be cheaper but segfault on CPU hosts (docs/cpu-hosts.md).
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            full = model.state_dict()
    elif backend == "zero3":
        import deepspeed  # heavy: deepspeed, for the ZeRO-3 naive gather only

        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            full = {n: p.detach().to("cpu", copy=True) for n, p in params.items()} if acc.is_main_process else None
    else:  # ddp, zero2: every rank already holds every weight
        full = {n: t.detach().to("cpu", copy=True) for n, t in model.state_dict().items()} if acc.is_main_process else None
    if not acc.is_main_process or not full:
        return None, 0
    nbytes = sum(t.numel() * t.element_size() for t in full.values() if isinstance(t, torch.Tensor))
    return {n: t for n, t in full.items() if "lora_" in n}, nbytes


def _random_step(rig: Rig, generator) -> None:
    """Collective: one optimizer step on random tokens, so the LoRA weights (B included) are non-zero."""
    # heavy: torch and the trainer's modules, needed by the worker ranks only (tests import cpu_launch_env from here)
    import torch

    ids = torch.randint(3, rig.policy.tokenizer.vocab_size, (4, 24), generator=generator)
    logits = rig.policy.model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))
    rig.acc.backward(loss)
    rig.policy.optimizer.step()
    rig.policy.optimizer.zero_grad(set_to_none=True)


def _same_tensors(gathered: dict, naive: dict, prefix_free) -> bool:
    """The LoRA-only gather and the naive one agree, key for key (naive names mapped to PEFT's)."""
    # heavy: torch and the trainer's modules, needed by the worker ranks only (tests import cpu_launch_env from here)
    import torch

    naive = prefix_free(naive)
    return set(gathered) == set(naive) and all(torch.equal(gathered[k], naive[k].to(gathered[k].dtype)) for k in gathered)


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows[1:] or rows)


def _measure_mode(rig: Rig, backend: str, mode: str, version0, generator, naive: bool = True) -> dict:
    """Collective: ROUNDS x (step, gather, write, publish, naive gather) with a fresh publisher in `mode`."""
    # heavy: torch and the trainer's modules, needed by the worker ranks only (tests import cpu_launch_env from here)
    import torch.distributed as dist

    from asyncgrpo.rollout.publish import AdapterPublisher
    from asyncgrpo.trainer.gather import (
        _to_peft_keys,
        clean_fsdp_name,
        gather_lora_state,
    )

    publisher = None
    if rig.main:
        publisher = AdapterPublisher(rig.clients, f"{rig.prefix}-{mode}", mode,
                                     adapter_root=rig.cfg.lora_adapter_path)
        publisher.publish(0, version0)  # the version requests would be using when the first sync comes
    peft_model = rig.acc.unwrap_model(rig.policy.model)

    def peft_keys(state):
        return _to_peft_keys(peft_model, {clean_fsdp_name(k).removeprefix("module."): v for k, v in state.items()})

    rows = []
    for _ in range(ROUNDS):
        _random_step(rig, generator)
        dist.barrier()
        step_end = time.perf_counter()
        stats: dict = {}
        tensors = gather_lora_state(rig.acc, rig.policy.model, stats)
        gathered = time.perf_counter()
        row = {"gather_s": gathered - step_end, "gathered_bytes": stats.get("gathered_bytes", 0)}
        if rig.main:
            rig.version += 1
            path = rig.store.write(rig.version, tensors, rig.policy.peft_config, base_model=rig.model_path)
            written = time.perf_counter()
            timing = publisher.publish(rig.version, path)
            served = time.perf_counter()
            publisher.retire(in_use=set())
            row.update(write_s=written - gathered, load_s=timing.load_s, pause_s=timing.paused_s,
                       server_s=timing.server_s, server_sum_s=timing.server_sum_s,
                       step_end_to_served_s=served - step_end,
                       adapter_bytes=sum(t.numel() * t.element_size() for t in tensors.values()))
        dist.barrier()
        if naive:
            t0 = time.perf_counter()
            full, naive_bytes = _naive_gather(backend, rig.acc, rig.policy.model)
            row.update(naive_gather_s=time.perf_counter() - t0, naive_gathered_bytes=naive_bytes)
            if rig.main:
                row["naive_matches"] = _same_tensors(tensors, full, peft_keys)
            del full
        rows.append(row)
    if not rig.main:
        return {}
    summary = {k: _median(rows, k) for k in ("gather_s", "write_s", "load_s", "pause_s", "server_s", "server_sum_s",
                                             "step_end_to_served_s")}
    summary.update(gathered_bytes=rows[-1]["gathered_bytes"], adapter_bytes=rows[-1]["adapter_bytes"],
                   rounds=len(rows), served_adapter=publisher.current_name)
    summary["gathered_over_adapter_bytes"] = summary["gathered_bytes"] / summary["adapter_bytes"]
    if naive:
        summary.update(naive_gather_s=_median(rows, "naive_gather_s"),
                       naive_gathered_bytes=rows[-1]["naive_gathered_bytes"],
                       naive_matches=all(r["naive_matches"] for r in rows))
        summary["naive_over_gather_s"] = summary["naive_gather_s"] / max(summary["gather_s"], 1e-9)
    return summary


def _score(rig: Rig, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
    """The policy's own fp32 logprob of every completion token, as the trainer computes it."""
    # heavy: torch and the trainer's modules, needed by the worker ranks only (tests import cpu_launch_env from here)
    from asyncgrpo.trainer.batching import score_completions
    from asyncgrpo.trainer.logprobs import sequence_logprobs

    tokenizer, model, head = rig.policy.tokenizer, rig.policy.model, rig.policy.scoring_head
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return score_completions(lambda b: sequence_logprobs(model, head, b["input_ids"], b["attention_mask"], b["mask"],
                                                         rig.cfg.temperature),
                             prompt_ids, completion_ids, pad_id, rig.acc.device)


def _policy_equivalence(rig: Rig, adapter: str | None) -> float:
    """Collective: max |served logprob - trainer logprob| over a few completions sampled from `adapter`."""
    # heavy: torch and the trainer's modules, needed by the worker ranks only (tests import cpu_launch_env from here)
    from asyncgrpo.distributed import broadcast_object

    sequences = None
    if rig.main:
        prompt = rig.policy.tokenizer.encode("61,16>")
        done = rig.clients[0].complete(adapter, prompt, n=4, max_tokens=6, temperature=1.0)
        sequences = [(prompt, c.token_ids, c.logprobs) for c in done]
    sequences = broadcast_object(sequences)
    mine = _score(rig, [p for p, _, _ in sequences], [c for _, c, _ in sequences])
    return max(abs(a - b) for row, (_, _, served) in zip(mine, sequences) for a, b in zip(row, served))


def worker(argv: list[str]) -> None:
    """Every rank (under `accelerate launch`): build the trainer's model, measure both sync modes."""
    # heavy: torch and the trainer's modules, needed by the worker ranks only (tests import cpu_launch_env from here)
    import torch

    from asyncgrpo.distributed import make_accelerator
    from asyncgrpo.store import AdapterStore
    from asyncgrpo.trainer.gather import backend_of, gather_lora_state
    from asyncgrpo.trainer.policy import PolicySettings, build_policy

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip_naive", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    cfg = AsyncGRPOConfig.load(default_config_path(), ["--torch_num_threads", "1", "--ddp_timeout", "600", *overrides])
    torch.set_num_threads(1)
    acc = make_accelerator(cfg.ddp_timeout)
    # Exactly the trainer's model: dtype, LoRA config, FSDP wrapping, prepare.
    policy = build_policy(cfg.section(PolicySettings), acc, cfg.model_name_or_path)
    rig = Rig(cfg, acc, policy, model_path=cfg.model_name_or_path)
    backend = backend_of(acc)
    version0 = None
    first = gather_lora_state(acc, rig.policy.model)  # version 0: LoRA B = 0
    if rig.main:
        rig.clients = [InferenceClient(url, api_key=cfg.api_key) for url in cfg.server_urls]
        for client in rig.clients:  # the first one also answers the logprob comparison
            client.wait_healthy(cfg.vllm_server_timeout)
        rig.prefix = f"bench-{os.getpid()}"
        rig.store = AdapterStore(Path(cfg.lora_adapter_path) / rig.prefix)
        version0 = rig.store.write(0, first, rig.policy.peft_config, base_model=rig.model_path)
    generator = torch.Generator().manual_seed(0)
    modes = {mode: _measure_mode(rig, backend, mode, version0, generator, naive=not args.skip_naive)
             for mode in ("pause", "versioned")}
    diff = _policy_equivalence(rig, modes["versioned"].get("served_adapter"))
    if rig.main:
        base_bytes = sum(p.numel() * p.element_size() for p in acc.unwrap_model(rig.policy.model).parameters())
        result = {"backend_detected": backend, "world_size": acc.num_processes, "modes": modes,
                  "servers": len(rig.clients),
                  "max_abs_logprob_diff": diff, "torch_dtype": cfg.torch_dtype, "lora_r": cfg.lora_r,
                  "local_param_bytes_rank0": base_bytes, "model": str(cfg.model_name_or_path)}
        Path(args.out).write_text(json.dumps(result))
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
