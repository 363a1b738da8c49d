"""`asyncgrpo demo --world agent`: train the toy agent (a `lookup` tool over a hidden table) end to end.

1. build (or find cached) the toy agent world and measure its base's held-out episodes locally (HF generate);
2. write the training config (environment_factory: the toy `LookupEnv`, reward: `lookup_reward`, max_turns 5; with
   `--agent-endpoint` the toy agent as an openai-client function instead, `asyncgrpo.toy.agent_client:run`);
3. start a local vLLM CPU server and `accelerate launch` the training against it, as `asyncgrpo demo` does;
4. measure the trained adapter's held-out episodes the same way; print success, turns and tool calls.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.children import run_group
from asyncgrpo.config import AsyncGRPOConfig, parse_overrides
from asyncgrpo.demo import launch_command, launch_environment
from asyncgrpo.errors import AsyncGRPOError
from asyncgrpo.inference.checks import adapters_needed
from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port

log = logging.getLogger("asyncgrpo.demo")

AGENT_KEYS = ("tools", "environment_factory", "max_turns", "max_episode_tokens", "tool_timeout")
"""The config keys of multi-turn episodes."""


def agent_config(world: Any, output_dir: str = "runs/demo-agent") -> dict[str, Any]:
    """The training config of the agent demo, as the mapping a YAML file would hold."""
    return {
        "model_name_or_path": str(world.model_dir),
        "dataset_name": str(world.train_file),  # rows: prompt (one user message), answer, key, hops, world_seed
        "reward_funcs": ["asyncgrpo.toy.agent_task:lookup_reward"],
        "tools": [],  # the environment's `lookup()` method is the one tool
        "environment_factory": "asyncgrpo.toy.agent_task:LookupEnv",
        "max_turns": 5,  # chains have at most 4 hops: 4 calls + the answer
        "max_episode_tokens": 200,  # a 4-hop episode is 132 tokens after a 42-token prompt; the model sees 256
        "tool_timeout": 10.0,
        "max_completion_length": 24,  # one turn: `@lookup()<|im_end|>` is 10 tokens, an answer `7<|im_end|>` 2
        "use_lora": True,
        "lora_adapter_path": f"{output_dir}/adapters",
        "lora_name": "demo-agent",
        "lora_r": 8,
        "lora_alpha": 16,
        "num_generations": 8,
        "temperature": 1.0,
        "per_device_train_batch_size": 64,  # 2 ranks x 64 = 16 questions x 8 episodes per step
        "learning_rate": 2.0e-3,
        "lr_scheduler_type": "constant",  # as the figures in docs/agents.md were measured (the default decays to 0)
        "max_steps": 40,
        "max_staleness": 1,
        "weight_sync_steps": 1,
        "output_dir": output_dir,
        "ddp_timeout": 900,
        "torch_num_threads": 1,
    }


AGENT_FUNCTION = "asyncgrpo.toy.agent_client:run"
"""The toy agent written with the openai client (`--agent-endpoint`)."""


def endpoint_config(values: dict[str, Any]) -> dict[str, Any]:
    """`agent_config`'s mapping with the toy agent run as an openai-client function through the agent endpoint: the
    same episodes (tool, turns, budgets), the agent's float as the reward instead of the environment and reward keys."""
    values = {k: v for k, v in values.items() if k not in ("tools", "environment_factory", "reward_funcs")}
    return {**values, "agent_function": AGENT_FUNCTION}


def load_agent_config(values: dict[str, Any]) -> AsyncGRPOConfig:
    """Validate the demo's mapping (every problem at once, as for a config file)."""
    return AsyncGRPOConfig.from_dict(values)


def episode_figures(model_dir: Path, rows: list[dict], adapter: Path | None = None) -> dict[str, dict[str, float]]:
    """Held-out episode figures, greedy and sampled (seed 1234), of the base or base + `adapter`, played locally."""
    # heavy: torch, transformers and peft (the agent's episodes too), needed only once the demo runs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.toy.agent_episodes import heldout_success

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return {"greedy": dataclasses.asdict(heldout_success(model, tokenizer, rows)),
            "sampled": dataclasses.asdict(heldout_success(model, tokenizer, rows, seed=1234))}


def summary_lines(before: dict, after: dict | None) -> dict[str, Any]:
    """The demo's printed summary: held-out success before and after, turns per episode, tool calls."""
    result: dict[str, Any] = {}
    for label, figures in (("before", before), ("after", after)):
        if figures is None:
            continue
        sampled = figures["sampled"]
        result[f"heldout_success_{label}"] = round(sampled["success"], 4)
        result[f"heldout_greedy_success_{label}"] = round(figures["greedy"]["success"], 4)
        result[f"turns_per_episode_{label}"] = round(sampled["turns_mean"], 3)
        result[f"tool_calls_per_episode_{label}"] = round(sampled["tool_calls_mean"], 3)
        result[f"tool_errors_{label}"] = sampled["tool_errors"]
    if after is not None:
        result["gain"] = round(result["heldout_success_after"] - result["heldout_success_before"], 4)
    return result


def run_agent_demo(args: Any, overrides: list[str]) -> int:
    """Build, serve, train and evaluate the toy agent; prints and writes demo_summary.json."""
    from asyncgrpo.toy.agent_world import build_agent_world  # heavy: torch and transformers

    logging.basicConfig(level=logging.INFO, format="[demo] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t_start = time.perf_counter()
    log.info("1/4 toy agent world (built once, then cached)")
    world = build_agent_world(log=lambda m: log.info("    %s", m))
    rows = world.read_rows(heldout=True)
    before = episode_figures(world.model_dir, rows)
    log.info("    base: %s", summary_lines(before, None))

    values = agent_config(world)
    if getattr(args, "agent_endpoint", False):
        values = endpoint_config(values)
        log.info("    the toy agent runs as %s through the agent endpoint", AGENT_FUNCTION)
    values = {**values, **parse_overrides(overrides)}
    cfg = load_agent_config(values)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "agent_config.yaml"
    config_path.write_text(yaml.safe_dump(values, sort_keys=False))
    log.info("2/4 config written to %s", config_path)

    port = args.port or find_free_port()
    log.info("3/4 vLLM CPU server on 127.0.0.1:%d, training %d steps on %d processes", port, cfg.max_steps,
             args.num_processes)
    server = VLLMServer(world.model_dir, port, max_lora_rank=max(8, cfg.lora_r),
                        max_loras=adapters_needed(cfg.max_staleness), max_model_len=256, log_path=out / "vllm.log")
    server.start()
    try:
        server.wait_ready(cfg.vllm_server_timeout)  # the config's wait for a healthy server (busy hosts start slowly)
        cmd = launch_command(args.num_processes, find_free_port(), config_path,
                             ["--vllm_server_base_url", server.base_url])
        t_train = time.perf_counter()
        if run_group(cmd, env=launch_environment()).returncode != 0:
            raise AsyncGRPOError(f"training failed; see the log above (server log: {out / 'vllm.log'})")
        train_s = time.perf_counter() - t_train
    finally:
        server.stop()
    run = json.loads((out / "run_summary.json").read_text())
    log.info("4/4 held-out episodes of the trained adapter %s", run["adapter_path"])
    after = episode_figures(world.model_dir, rows, Path(run["adapter_path"]))
    result = {**summary_lines(before, after), "steps": run["steps"], "train_seconds": round(train_s, 1),
              "total_seconds": round(time.perf_counter() - t_start, 1), "adapter": run["adapter_path"]}
    (out / "demo_summary.json").write_text(json.dumps(result, indent=2))
    print("\n=== asyncgrpo demo --world agent ===")
    for key, value in result.items():
        print(f"{key:>32}: {value}")
    return 0
