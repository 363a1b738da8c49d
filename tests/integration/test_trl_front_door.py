"""A TRL user's front door, end to end with one single-process run against the session's vLLM server: a TRL
GRPOConfig YAML, as TRL users write one, trains the toy world with no edit (its `num_train_epochs` counted into 2
steps), and the final adapter it leaves in `output_dir` loads with PEFT's `PeftModel.from_pretrained`, with
`AutoPeftModelForCausalLM` (from the `base_model_name_or_path` it records) and on the vLLM server, each giving the
logprobs of the final version the run served.

The server loads the output directory through `/v1/load_lora_adapter`: vLLM reads a `--lora-modules` directory at
start through the same PEFT-format loader (a LoRA request naming the directory), so the session server is reused
instead of starting another one.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch

from asyncgrpo.bench.sync import cpu_launch_env

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3 + b for b in b"61,16>"]  # the toy tokenizer: one token per character
PROMPTS_PER_STEP = 4  # per_device_train_batch_size 32 / num_generations 8, one process
TOY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the toy's linear layers

TRL_YAML = """\
model_name_or_path: {model}
dtype: bfloat16
use_peft: true
lora_r: 8
lora_alpha: 16
lora_dropout: 0.0
lora_target_modules: all-linear
lora_task_type: CAUSAL_LM
dataset_name: {data}
reward_funcs:
- asyncgrpo.toy.larger_reward
bf16: true
use_vllm: true
vllm_mode: server
vllm_server_base_url: {url}
vllm_server_timeout: 60
vllm_gpu_memory_utilization: 0.3
vllm_importance_sampling_clip_max: 3.0
num_generations: 8
max_completion_length: 4
temperature: 1.0
per_device_train_batch_size: 32
gradient_accumulation_steps: 1
gradient_checkpointing: false
learning_rate: 2.0e-3
lr_scheduler_type: cosine
warmup_steps: 0.1
num_train_epochs: {epochs!r}
max_steps: -1
optim: adamw_torch
beta: 0.0
loss_type: dapo
logging_strategy: steps
logging_steps: 1
log_level: info
save_strategy: steps
save_steps: 2
resume_from_checkpoint: false
remove_unused_columns: false
push_to_hub: false
seed: 0
output_dir: {out}
"""


def score(model, completion_ids) -> torch.Tensor:
    ids = torch.tensor([PROMPT + list(completion_ids)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logprobs[len(PROMPT) - 1:].gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)


def test_a_trl_yaml_trains_and_its_final_adapter_passes_peft_auto_peft_and_vllm(world, vllm_server, client, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    rows = sum(1 for _ in open(world.train_file))
    out = tmp_path / "out"
    config = tmp_path / "grpo.yaml"
    config.write_text(TRL_YAML.format(model=world.model_dir, data=world.train_file, url=vllm_server.base_url,
                                      epochs=1.5 * PROMPTS_PER_STEP / rows, out=out))
    # TRL's command-line forms on top: a bare boolean, a space-separated list (all-linear's modules, written out)
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo", "train", "--config", str(config), "--use_peft",
                           "--lora_target_modules", *TOY_LINEAR], cwd=REPO, env=cpu_launch_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert proc.stderr.count("take asyncgrpo's defaults, not TRL's") == 1  # told once, the keys it left out
    assert "\n  delta: 3.0 (TRL: unset" in proc.stderr
    summary = json.loads((out / "run_summary.json").read_text())
    assert (summary["steps"], summary["version"], summary["base_dtype"]) == (2, 2, "bfloat16")  # ceil(1.5) steps
    assert (out / "checkpoint-2").is_dir() and (out / "adapters").is_dir()  # save_steps; the default adapter path
    assert summary["final_adapter"] == str(out.resolve())

    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(world.model_dir)  # a local base: its absolute path
    targets = {name.rsplit(".", 1)[-1] for name in adapter_config["target_modules"]}  # PEFT expands all-linear
    assert targets == set(TOY_LINEAR)

    served = client.complete(summary["adapter_name"], PROMPT, n=1, max_tokens=3, temperature=1.0)[0]
    want = torch.tensor(served.logprobs)
    base = AutoModelForCausalLM.from_pretrained(world.model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    assert torch.allclose(score(peft_model, served.token_ids), want, atol=1e-3, rtol=0)
    auto_model = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert torch.allclose(score(auto_model, served.token_ids), want, atol=1e-3, rtol=0)
    with peft_model.disable_adapter():
        untrained = score(peft_model, served.token_ids)
    assert not torch.allclose(untrained, want, atol=1e-3, rtol=0)  # the trained adapter is what makes them agree

    name = "trl-front-door-final"
    client.load_adapter(name, out)
    try:
        again = client.complete(name, PROMPT, n=1, max_tokens=3, temperature=1.0)[0]
        assert torch.allclose(score(peft_model, again.token_ids), torch.tensor(again.logprobs), atol=1e-3, rtol=0)
    finally:
        client.unload_adapter(name)
        client.unload_adapter(summary["adapter_name"])  # the run left its final version loaded (keep_final_adapter)
