"""`asyncgrpo train` on a user's own data: a local GSM8K-format file, chat prompts through the tokenizer's chat
template, the built-in math reward plus a user's reward module, against the real vLLM CPU server (toy model)."""

import json
import os
import subprocess
import sys

import pytest

from asyncgrpo.demo import launch_environment

QUESTIONS = [
    ("Natalia sold 48 clips in April and half as many in May. How many in all?",
     "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"),
    ("Weng earns $12 an hour. How much for 50 minutes?",
     "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nShe earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"),
    ("What is 17 + 25?", "17 + 25 = <<17+25=42>>42\n#### 42"),
    ("What is 1000 + 234?", "1000 + 234 = 1234\n#### 1,234"),
    ("What is 9 x 9?", "9 x 9 = <<9*9=81>>81\n#### 81"),
    ("What is 60 - 18?", "60 - 18 = <<60-18=42>>42\n#### 42"),
    ("Say hello.", ""),  # no reference: math_accuracy returns None (not applicable) for this row
]
# One token per character in the toy tokenizer: these exceed max_model_len 256 - max_completion_length 16.
TOO_LONG = [("What is 7 x 6? " + "Think very carefully. " * 12, "#### 42"),
            ("What is 8 x 8? " + "Explain every step. " * 14, "#### 64")]

USER_REWARDS = '''
def parsed_reply(prompts, completions, parsed=None, **columns):
    """1.0 for each completion that arrived parsed into an assistant message."""
    if parsed is None:
        raise ValueError("no parsed messages")
    return [1.0 if isinstance(p, dict) and p.get("role") == "assistant" else 0.0 for p in parsed]
'''

CONFIG = r"""
model_name_or_path: toy
dataset_name: {data}
prompt_column: question
prompt_format: chat
system_prompt: 'Answer with \boxed{{N}}.'
reward_funcs: [asyncgrpo.rewards:math_accuracy, my_rewards:parsed_reply, asyncgrpo.rewards:length_penalty]
reward_weights: [1.0, 0.1, 0.5]
reward_kwargs:
  length_penalty: {{max_length: 16, soft_length: 8}}
lora_adapter_path: {out}/adapters
output_dir: {out}
learning_rate: 2.0e-3
lr_scheduler_type: constant
ddp_timeout: 120
vllm_server_timeout: 30   # ddp_timeout must exceed an outage: 30 + 40 + 45.5 s of retries
vllm_request_timeout: 40
torch_num_threads: 1
"""


@pytest.fixture(scope="module")
def own_data_run(vllm_server, world, tmp_path_factory):
    out = tmp_path_factory.mktemp("own_data")
    data = out / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS + TOO_LONG))
    (out / "my_rewards.py").write_text(USER_REWARDS)
    config = out / "train.yaml"
    config.write_text(CONFIG.format(data=data, out=out))
    env = launch_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(out), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "asyncgrpo", "train", "--config", str(config),
           "--vllm_server_base_url", vllm_server.base_url, "--max_steps", "3", "--per_device_train_batch_size", "16",
           "--num_generations", "8", "--max_completion_length", "16"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "run_summary.json").read_text()), proc


def test_a_local_gsm8k_file_trains_end_to_end_in_one_process(own_data_run, client, tb_scalars):
    out, summary, _ = own_data_run
    assert summary["steps"] == 3 and summary["version"] == 3
    assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    assert [v for _, v in tb_scalars(out / "tensorboard", "policy/version")] == [1.0, 2.0, 3.0]


def test_each_reward_function_has_its_own_mean_in_tensorboard(own_data_run, tb_scalars):
    out, _, _ = own_data_run
    accuracy = [v for _, v in tb_scalars(out / "tensorboard", "train/rewards/math_accuracy/mean")]
    penalty = [v for _, v in tb_scalars(out / "tensorboard", "train/rewards/length_penalty/mean")]
    assert len(accuracy) == 3 and all(0.0 <= v <= 1.0 for v in accuracy)
    assert len(penalty) == 3 and all(-1.0 <= v <= 0.0 for v in penalty)


def test_chat_completions_reach_the_users_reward_function_parsed(own_data_run, tb_scalars):
    """The toy tokenizer has no response template of its own; transformers ships one for its model type (qwen2)."""
    out, _, _ = own_data_run
    assert [v for _, v in tb_scalars(out / "tensorboard", "train/rewards/parsed_reply/mean")] == [1.0, 1.0, 1.0]


def test_over_long_prompts_are_skipped_and_counted(own_data_run, tb_scalars):
    out, _, proc = own_data_run
    assert tb_scalars(out / "tensorboard", "data/prompts_skipped_too_long") == [(0, 2.0)]
    assert "skipped 2 of 9 prompts" in proc.stderr and "2 longer than 240 tokens" in proc.stderr
