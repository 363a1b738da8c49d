"""Every architecture users train, end to end: a tiny random model built from transformers' own config classes
(asyncgrpo.toy.architectures), served by a real vLLM CPU server, one LoRA step trained by the trainer's own code
(one process, on-policy), the adapter it published accepted by that server, and PEFT on the base reproducing the
server's logprobs. One server at a time (module-scoped, parametrized: pytest stops one before starting the next).
Qwen2, the toy's architecture, runs the same checks in test_training.py and test_backends.py. docs/models.md is the
table of what runs here."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from integration.runs import make_server
from safetensors.torch import load_file

from asyncgrpo.demo import default_config_path, launch_command, launch_environment
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import find_free_port
from asyncgrpo.toy.architectures import build_tiny_model

PROMPT = [3 + b for b in b"61,16>"]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Where the decoder layers sit in transformers' module tree, i.e. the adapter's keys (PEFT adds base_model.model.).
DECODER_PREFIX = {"qwen3": "model.layers.", "llama": "model.layers.", "gemma3": "model.layers.",
                  "gemma4": "model.layers.", "gemma4-wrapper": "model.language_model.layers."}


# vLLM flags beyond VLLMServer's. vLLM serves a Gemma4ForConditionalGeneration checkpoint through its multimodal
# wrapper, which needs transformers' Gemma4Processor, which needs torchvision: this CPU environment has none, and the
# server stops at start-up ("Could not import module 'Gemma4Processor'", docs/models.md). vLLM's text-only
# Gemma4ForCausalLM loads the same checkpoint (dropping the vision tower) and maps the same adapter keys
# (model.language_model.* -> model.*): that is what runs here.
TEXT_ONLY = ["--hf-overrides", json.dumps({"architectures": ["Gemma4ForCausalLM"]})]
SERVE_ARGS = {"gemma4-wrapper": TEXT_ONLY}


@pytest.fixture(scope="module", params=list(DECODER_PREFIX))
def trained(request, tmp_path_factory):
    """A server on a fresh tiny model of the architecture, and one on-policy LoRA step (max_staleness 0, fp32, one
    process) against it: (architecture, model directory, client, run summary). The training process starts with
    the server (it waits for /health itself), so that its imports overlap vLLM's start-up."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"arch-{arch}")
    model_dir = build_tiny_model(arch, root / "model")
    server = make_server(model_dir, find_free_port(), max_model_len=256, extra_args=SERVE_ARGS.get(arch, []),
                         log_path=root / "vllm.log")
    # A random model never answers the toy task: reward a letter or digit in its 4 random tokens instead (~37% of
    # completions), so that every group of 8 has different rewards and the step moves every LoRA B.
    overrides = ["--model_name_or_path", str(model_dir), "--max_steps", "1", "--per_device_train_batch_size", "32",
                 "--reward_funcs", "asyncgrpo.rewards:format_reward",
                 "--reward_kwargs", "{format_reward: {pattern: '[0-9a-z]'}}",
                 "--max_staleness", "0", "--torch_dtype", "float32", "--learning_rate", "5e-2",
                 "--output_dir", str(root / "run"), "--lora_adapter_path", str(root / "run" / "adapters"),
                 "--vllm_server_base_url", server.base_url]
    server.start()  # stopped at the end of this architecture's tests
    try:
        with open(root / "train.log", "w") as log:
            proc = subprocess.Popen(launch_command(1, find_free_port(), default_config_path(), overrides),
                                    env=launch_environment(), stdout=log, stderr=subprocess.STDOUT)
        try:
            server.wait_ready()
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert code == 0, (root / "train.log").read_text()[-5000:]
        with InferenceClient(server.base_url) as client:
            yield arch, model_dir, client, json.loads((root / "run" / "run_summary.json").read_text())
    finally:
        server.stop()


def peft_logprobs(model_dir, adapter_dir, prompt, completion):
    """The completion's logprobs (fp32) with the adapter loaded by PEFT onto the base transformers builds."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logprobs[len(prompt) - 1:].gather(-1, ids[0, len(prompt):, None]).squeeze(-1)


def test_the_trainer_scores_the_servers_samples_as_the_server_did(trained, tb_scalars):
    *_, summary = trained
    assert summary["version"] == 1
    ratios = [v for _, v in tb_scalars(summary["tensorboard"], "train/max_abs_log_ratio")]
    assert len(ratios) == 1 and ratios[0] < 1e-3, ratios  # the same forward in transformers and vLLM, fp32


def test_the_published_adapter_has_transformers_module_names_for_every_target(trained):
    arch, *_, summary = trained
    tensors = load_file(f"{summary['adapter_path']}/adapter_model.safetensors")
    prefix = f"base_model.model.{DECODER_PREFIX[arch]}"
    expected = {f"{prefix}{layer}.{'self_attn' if m.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}"
                f".{m}.lora_{ab}.weight" for layer in (0, 1) for m in MODULES for ab in "AB"}
    assert set(tensors) == expected  # the decoder's modules only: none in the wrapper's vision tower
    assert min(t.abs().max().item() for k, t in tensors.items() if "lora_B" in k) > 0  # the step moved every B


def test_the_server_serves_the_published_adapter_and_peft_reproduces_its_logprobs(trained):
    _, model_dir, client, summary = trained
    assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    base = client.complete(client.base_model(), PROMPT, n=1, max_tokens=6, temperature=1.0)[0]
    for completion in client.complete(summary["adapter_name"], PROMPT, n=4, max_tokens=6, temperature=1.0):
        mine = peft_logprobs(model_dir, summary["adapter_path"], PROMPT, completion.token_ids)
        assert torch.allclose(mine, torch.tensor(completion.logprobs), atol=1e-3, rtol=0), (mine, completion.logprobs)
    # The adapter changed what is served (a server that ignored its modules would serve the base's logprobs).
    with_adapter = client.score(summary["adapter_name"], PROMPT + base.token_ids)[len(PROMPT):]
    assert max(abs(a - b) for a, b in zip(with_adapter, base.logprobs)) > 1e-3
