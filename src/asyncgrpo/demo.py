"""`asyncgrpo demo`: the whole data path on one machine, with real parts.

1. build (or find cached) the toy world: tiny Qwen2, local tokenizer, "which is larger" task, warmed-up base;
2. start a local vLLM CPU server with LoRA hot reload;
3. measure the held-out reward of the base model through the server;
4. `accelerate launch` N CPU processes of `asyncgrpo train` (DDP over gloo) against the server;
5. measure the held-out reward of the trained adapter through the server, print a summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from asyncgrpo.children import run_group
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import load_prompts
from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.inference.checks import adapters_needed
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port, served_lora_rank
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.evaluation import evaluate_served
from asyncgrpo.rollout.scoring import InThreadScoring

log = logging.getLogger("asyncgrpo.demo")

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_config_path() -> Path:
    for candidate in (Path("configs/demo.yaml"), REPO_ROOT / "configs" / "demo.yaml"):
        if candidate.is_file():
            return candidate
    raise AsyncGRPOError("configs/demo.yaml not found; run from the repository root or pass --config")


def launch_command(num_processes: int, port: int, config: Path, overrides: list[str]) -> list[str]:
    """`accelerate launch` of `asyncgrpo train` as N CPU processes (DDP over gloo)."""
    if num_processes == 1:
        return [sys.executable, "-m", "asyncgrpo", "train", "--config", str(config), *overrides]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
            "--num_processes", str(num_processes), "--mixed_precision", "no", "--main_process_port", str(port),
            "-m", "asyncgrpo", "train", "--config", str(config), *overrides]


def launch_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"ACCELERATE_USE_CPU": "true", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    return env


def heldout_rewards(cfg: AsyncGRPOConfig, client, model: str, world) -> dict[str, float]:
    """Held-out reward of `model` on the server: the mean over 4 samples per prompt at the training temperature
    (the quantity GRPO maximises), and greedy accuracy; the same evaluation a run does every `eval_steps`."""
    from transformers import AutoTokenizer  # heavy: transformers, not needed by the CLI that imports this module

    tokenizer = AutoTokenizer.from_pretrained(world.model_dir)
    rows = load_prompts(world.heldout_file, tokenizer, cfg.prompt_column)
    scorer = InThreadScoring(RewardScorer(cfg.reward_funcs, cfg.reward_weights), tokenizer)
    common = dict(max_tokens=cfg.max_completion_length)
    return {"sampled": evaluate_served(client, model, rows, scorer, temperature=cfg.temperature, n=4,
                                       **common).reward,
            "greedy": evaluate_served(client, model, rows, scorer, temperature=0.0, **common).reward}


@contextlib.contextmanager
def inference_node(args, cfg: AsyncGRPOConfig, model_dir, out: Path):
    """Yields the inference node's base URL: the one given with `--server` (a node started elsewhere, which must
    serve `model_dir` with LoRA hot reload), else a local vLLM CPU server started here and stopped on exit."""
    if getattr(args, "server", None):
        log.info("2/5 the inference node at %s (started elsewhere)", args.server)
        yield args.server.rstrip("/")
        return
    port = args.port or find_free_port()
    log.info("2/5 vLLM CPU server on 127.0.0.1:%d (log: %s)", port, out / "vllm.log")
    server = VLLMServer(model_dir, port, max_lora_rank=served_lora_rank(max(8, cfg.lora_r)),
                        max_loras=adapters_needed(cfg.max_staleness), max_model_len=256, log_path=out / "vllm.log")
    with server:
        yield server.base_url


def run_demo(args, overrides: list[str]) -> int:
    from asyncgrpo.toy import ToyWorldSpec, build_toy_world  # heavy: the toy world imports torch and transformers

    logging.basicConfig(level=logging.INFO, format="[demo] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config_path = Path(args.config) if args.config else default_config_path()
    cfg = AsyncGRPOConfig.load(config_path, overrides)
    t_start = time.perf_counter()

    log.info("1/5 toy world (built once, then cached)")
    world = build_toy_world(ToyWorldSpec(seed=cfg.toy_seed), log=lambda m: log.info("    %s", m))
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    with inference_node(args, cfg, world.model_dir, out) as base_url:
        client = InferenceClient(base_url, timeout_s=cfg.vllm_request_timeout)
        log.info("3/5 held-out reward of the base model (%s)", world.heldout_file)
        before = heldout_rewards(cfg, client, client.base_model(), world)
        log.info("    base: %s", before)

        log.info("4/5 training: %d processes, %d steps", args.num_processes, cfg.max_steps)
        train_overrides = [*overrides, "--vllm_server_base_url", base_url]
        cmd = launch_command(args.num_processes, find_free_port(), config_path, train_overrides)
        t_train = time.perf_counter()
        proc = run_group(cmd, env=launch_environment())
        if proc.returncode != 0:
            raise AsyncGRPOError(f"training exited with code {proc.returncode}; see the log above "
                                 f"(server log: {out / 'vllm.log'} when the demo started the server)")
        train_s = time.perf_counter() - t_train
        summary = json.loads((out / "run_summary.json").read_text())

        log.info("5/5 held-out reward of the trained adapter %s", summary["adapter_name"])
        after = heldout_rewards(cfg, client, summary["adapter_name"], world)
        log.info("    trained: %s", after)

    result = {"heldout_reward_before": round(before["sampled"], 4), "heldout_reward_after": round(after["sampled"], 4),
              "gain": round(after["sampled"] - before["sampled"], 4),
              "heldout_greedy_accuracy_before": round(before["greedy"], 4),
              "heldout_greedy_accuracy_after": round(after["greedy"], 4),
              "steps": summary["steps"], "policy_version": summary["version"],
              "train_seconds": round(train_s, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
              "groups_dropped_stale": summary["dropped_stale"], "adapter": summary["adapter_path"],
              "tensorboard": f"tensorboard --logdir {summary['tensorboard']}"}
    (out / "demo_summary.json").write_text(json.dumps(result, indent=2))
    print("\n=== asyncgrpo demo ===")
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    return 0
