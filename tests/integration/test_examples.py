"""The three scripts in examples/ run as a user runs them, on the toy model against the session's real vLLM server:
the math one under `accelerate launch` on 2 gloo ranks with its reward function sent to a reward worker and the
rollout process (both run the script again to import it), the tool agent and the environment class in one process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent_format import agent_model

from asyncgrpo.demo import launch_environment
from asyncgrpo.inference_node.vllm_server import find_free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
COMMON = ["--vllm_server_timeout", "30", "--vllm_request_timeout", "60", "--ddp_timeout", "300",
          "--torch_num_threads", "1", "--lr_scheduler_type", "constant", "--learning_rate", "1e-3"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=launch_environment(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_the_math_example_trains_its_own_reward_and_data_on_two_ranks_through_a_reward_worker_and_the_rollout_process(
        vllm_server, tmp_path, tb_scalars):
    out = tmp_path / "math"
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
                "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(find_free_port()),
                str(EXAMPLES / "math_lora.py"), "--model_name_or_path", "toy", "--output_dir", str(out),
                "--vllm_server_base_url", vllm_server.base_url, "--max_completion_length", "4",
                "--per_device_train_batch_size", "16", "--max_steps", "3", "--eval_strategy", "steps",
                "--eval_steps", "3", "--reward_workers", "1", "--rollout_process", *COMMON])
    summary = json.loads((out / "run_summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (3, 2)
    # the callback's on_log ran on rank 0 alone, once per step, and on_evaluate after the evaluation at step 3
    logged = [line for line in proc.stdout.splitlines() if ": reward " in line]
    assert [line.split(":")[0] for line in logged] == ["step 1", "step 2", "step 3"], proc.stdout[-2000:]
    assert sum(line.startswith("step 3: eval {") for line in proc.stdout.splitlines()) == 1, proc.stdout[-2000:]
    # the script's function scored (under its own name), and it is the function: the toy base is right ~29% of the time
    means = [v for _, v in tb_scalars(out / "tensorboard", "train/rewards/correct_answer/mean")]
    assert len(means) == 3 and 0.0 < max(means) <= 1.0, means
    # train() returned TRL's TrainOutput: the step reached and the mean of the three steps' losses (float32 in the log)
    losses = [v for _, v in tb_scalars(out / "tensorboard", "train/loss")]
    step, loss = re.search(r"trained to step (\d+), mean loss (\S+)", proc.stdout).groups()
    assert int(step) == 3 and float(loss) == pytest.approx(sum(losses) / 3, rel=1e-5, abs=1e-7), (loss, losses)
    # the Dataset objects reached the rollout process as save_to_disk directories in output_dir
    config = (out / "config.yaml").read_text()
    assert f"dataset_name: {out.resolve() / 'datasets' / 'train'}" in config
    assert (out / "datasets" / "eval" / "dataset_info.json").is_file()
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (8, 16)  # the LoraConfig's
    assert sorted(adapter["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])


def test_the_tool_agent_and_the_environment_examples_train_episodes_that_call_their_tools(
        world, vllm_server, tmp_path, tb_scalars):
    model_dir = agent_model(world, tmp_path)  # the toy model with a tool-calling chat format (tests/agent_format.py)
    for script, reward in (("tool_agent.py", "final_answer"), ("environment.py", "Vault")):
        out = tmp_path / script
        run([sys.executable, str(EXAMPLES / script), "--model_name_or_path", str(model_dir), "--output_dir", str(out),
             "--vllm_server_base_url", vllm_server.base_url, "--max_steps", "2", "--max_turns", "3",
             "--max_completion_length", "12", "--lora_name", out.stem, *COMMON])
        assert json.loads((out / "run_summary.json").read_text())["steps"] == 2
        tb = out / "tensorboard"
        assert len(tb_scalars(tb, f"train/rewards/{reward}/mean")) == 2, script
        assert tb_scalars(tb, "episodes/tool_calls_total")[-1][1] > 0, script  # the script's tool ran
