"""A model that ships sampling defaults (generation_config.json with top_k 20 and repetition_penalty 1.05, what
Qwen2.5-Instruct ships) does not bias training: the client sends every sampling field, the launch files serve with
`--generation-config vllm`, and `doctor` refuses a server that applies the model's defaults.

Two real vLLM servers on the toy-world variant with those defaults, started side by side (a vLLM start is one Python
process at a time: two take about as long as one on 2 cores): one started like a stock `vllm serve`
(`--generation-config auto`, where the defaults are live), stopped after its tests, and one with our launch flags,
which an on-policy training run uses."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
import requests
import torch
from integration.runs import make_server

from asyncgrpo.demo import default_config_path, launch_command, launch_environment
from asyncgrpo.inference.checks import ServerContext, check_generation_config
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference_node.vllm_server import find_free_port

PROMPT = [3 + b for b in b"61,16>"]  # both operands' digits recur in the answer: a repetition penalty bites


@pytest.fixture(scope="module")
def qwen_like(world):
    from asyncgrpo.toy import with_generation_defaults

    variant = with_generation_defaults(world)
    assert json.loads((variant.model_dir / "generation_config.json").read_text())["top_k"] == 20
    return variant


START_S = 600  # a vLLM CPU start takes ~30 s on 2 quiet cores, minutes on a loaded one


@pytest.fixture(scope="module")
def servers(qwen_like, tmp_path_factory):
    """generation_config -> its server, both started at once (each class's fixture waits for its own)."""
    made = {}
    try:
        for generation_config in ("auto", "vllm"):
            log = tmp_path_factory.mktemp(f"vllm-gen-{generation_config}") / "vllm.log"
            made[generation_config] = make_server(qwen_like.model_dir, find_free_port(), max_model_len=256,
                                                  generation_config=generation_config, log_path=log)
            made[generation_config].start()
        yield made
    finally:
        for server in made.values():
            server.stop()


def serve(servers, generation_config: str):
    """A client of that server once it is ready; the server is stopped after the class that asked for it."""
    server = servers[generation_config]
    try:
        server.wait_ready(START_S)
        with InferenceClient(server.base_url) as client:
            yield client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def full_softmax(qwen_like):
    """`full_softmax(completion)`: its logprobs after PROMPT under the untruncated, unpenalised softmax (fp32,
    temperature 1), i.e. what the trainer scores."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen_like.model_dir, dtype=torch.float32).eval()

    def score(completion: list[int]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + list(completion)])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        return logprobs[len(PROMPT) - 1:].gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)

    return score


def doctor_ctx(client, model_dir, *, read_back: bool) -> ServerContext:
    ctx = ServerContext(SimpleNamespace(), client, str(model_dir))
    if not read_back:
        ctx.cache["server_config"] = None  # as on a server without VLLM_SERVER_DEV_MODE: the probe decides
    return ctx


@pytest.fixture(scope="class")
def stock(servers):
    """`--generation-config auto`, vLLM's default: the model's top_k and repetition_penalty fill omitted fields."""
    yield from serve(servers, "auto")


@pytest.fixture(scope="class")
def served(servers):
    """Served the way launch/vllm/serve.sh and VLLMServer serve: `--generation-config vllm`."""
    yield from serve(servers, "vllm")


class TestStockServer:
    """A server that fills omitted fields from the model's generation_config.json (stopped after this class)."""

    def test_explicit_sampling_fields_give_the_full_softmax_and_omitting_them_does_not(self, stock, full_softmax):
        base = stock.base_model()
        completions = stock.complete(base, PROMPT, n=32, max_tokens=3, temperature=1.0)
        for c in completions:
            reference = full_softmax(c.token_ids)
            assert torch.allclose(torch.tensor(c.logprobs), reference, atol=1e-4, rtol=0), (c.logprobs, reference)
        # The body the client sent before the fix (temperature and top_p only): the server samples from the
        # truncated, penalised distribution and reports its logprobs, not the trainer's.
        with requests.Session() as session:
            session.trust_env = False  # a local server: never through a proxy
            old = session.post(f"{stock.base_url}/v1/completions", timeout=60, json={
                "model": base, "prompt": PROMPT, "n": 32, "max_tokens": 3, "temperature": 1.0, "top_p": 1.0,
                "logprobs": 0, "return_token_ids": True}).json()
        off = max((torch.tensor(ch["logprobs"]["token_logprobs"])
                   - full_softmax(ch["token_ids"])).abs().max().item()
                  for ch in old["choices"])
        assert off > 1e-3, off  # measured 0.058 over 64 completions (explicit fields: 1.5e-6)

    @pytest.mark.parametrize("read_back", [True, False], ids=["server_info", "probe"])
    def test_doctor_refuses_a_server_that_applies_model_sampling_defaults(self, stock, qwen_like, read_back):
        result = check_generation_config(doctor_ctx(stock, qwen_like.model_dir, read_back=read_back))
        assert result.ok is False, result.line()
        assert "from the model's generation_config.json" in result.detail
        assert ("--generation-config auto" in result.detail) == read_back
        assert result.fix.startswith("restart the server with --generation-config vllm")


class TestLaunchFlags:
    """A server with our launch flags (the stock one has stopped by now)."""

    def test_doctor_passes_with_generation_config_vllm(self, served, qwen_like):
        assert check_generation_config(doctor_ctx(served, qwen_like.model_dir, read_back=True)).detail == \
            "--generation-config vllm"
        probed = check_generation_config(doctor_ctx(served, qwen_like.model_dir, read_back=False))
        assert probed.ok is True and "changes no logprobs" in probed.detail, probed.line()

    def test_on_policy_training_is_exact_on_a_model_with_sampling_defaults(self, served, qwen_like, tmp_path,
                                                                            tb_scalars):
        overrides = ["--model_name_or_path", str(qwen_like.model_dir), "--max_steps", "2",
                     "--per_device_train_batch_size", "32", "--max_staleness", "0", "--torch_dtype", "float32",
                     "--learning_rate", "1e-2", "--output_dir", str(tmp_path),
                     "--lora_adapter_path", str(tmp_path / "adapters"), "--vllm_server_base_url", served.base_url]
        cmd = launch_command(1, find_free_port(), default_config_path(), overrides)
        proc = subprocess.run(cmd, env=launch_environment(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        ratios = [v for _, v in tb_scalars(tmp_path / "tensorboard", "train/max_abs_log_ratio")]
        # fp32 on both sides: ~1e-6 of noise. Sampling with the model's top_k 20 / repetition_penalty 1.05 measured
        # 0.30 at step 1.
        assert len(ratios) == 2 and max(ratios) < 1e-3, ratios
