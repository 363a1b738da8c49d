"""Sampling the trainer can model: every request states every sampling field, the server is started with
`--generation-config vllm`, `top_p < 1` is refused, and the doctor's read-back of /server_info tells a server that
applies the model's sampling defaults from one that does not. The real servers (one applying the defaults, one not)
are in tests/integration/test_sampling_defaults.py; here an in-process stub records what the client sends, which a
real server cannot show."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.inference_node.vllm_server import VLLMServer
from asyncgrpo.inference.checks import ServerContext, check_generation_config
from asyncgrpo.inference.client import InferenceClient

COMPLETION = {"model": "m", "choices": [{"index": 0, "text": "7", "token_ids": [10], "finish_reason": "stop",
                                        "logprobs": {"token_logprobs": [-0.5]},
                                        "prompt_logprobs": [None, {"6": {"logprob": -1.0}}]}]}
NEUTRAL = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def test_completion_and_score_requests_send_every_sampling_field_at_its_neutral_value(stubs):
    stub = stubs(lambda s, h: (200, "application/json", json.dumps(COMPLETION)))
    with InferenceClient(stub.url) as client:
        client.complete("m", [5, 6], n=2, max_tokens=3, temperature=0.7)
        client.score("m", [5, 6])
    sent = [json.loads(r["body"]) for r in stub.requests]
    assert [{k: body[k] for k in NEUTRAL} for body in sent] == [NEUTRAL, NEUTRAL]
    assert [(body["temperature"], body["top_p"]) for body in sent] == [(0.7, 1.0), (1.0, 1.0)]


def test_server_command_uses_vllms_neutral_generation_config():
    cmd = VLLMServer("/m", 9000).command()
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"
    assert cmd.count("--generation-config") == 1


@pytest.mark.parametrize("top_p", [0.95, 0.5])
def test_top_p_below_one_is_refused_with_the_fix(top_p):
    with pytest.raises(ConfigError) as err:
        AsyncGRPOConfig(model_name_or_path="toy", use_lora=True, lora_adapter_path="/tmp/a", top_p=top_p).validate()
    assert err.value.field == "top_p"
    assert f"config `top_p`: {top_p} is not supported" in str(err.value)
    assert str(err.value).endswith("Fix: set `top_p: 1.0` (the default)")


class ReadBack:
    """A client whose /server_info says how the server fills omitted sampling fields; it has no completions."""

    base_url = "http://node:8000"

    def __init__(self, model_config):
        self.model_config = model_config

    def server_config(self):
        return {"model_config": self.model_config}

    def base_model(self):
        raise AssertionError("read-back alone decides: no probe request")


def test_doctor_reads_back_generation_config_and_sampling_overrides():
    def check(model_config):
        return check_generation_config(ServerContext(SimpleNamespace(), ReadBack(model_config), "/m"))

    assert check({"generation_config": "vllm", "override_generation_config": {}}).line() == \
        "PASS  no model sampling defaults: --generation-config vllm"
    assert check({"generation_config": "vllm", "override_generation_config": {"top_k": 20, "max_new_tokens": 9}}) \
        .line() == ("FAIL  no model sampling defaults: --override-generation-config sets top_k for every request "
                    "that leaves them out. Fix: remove them from --override-generation-config")
