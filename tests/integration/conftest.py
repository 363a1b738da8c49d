"""One real vLLM CPU server for the whole integration session, serving the toy world's base model."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def world():
    from asyncgrpo.toy import build_toy_world

    return build_toy_world()


@pytest.fixture(scope="session")
def vllm_server(world, tmp_path_factory):
    from asyncgrpo.inference.server import VLLMServer, find_free_port

    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = VLLMServer(world.model_dir, find_free_port(), max_lora_rank=8, max_loras=4, max_model_len=256,
                        log_path=log)
    with server:
        yield server


@pytest.fixture()
def client(vllm_server):
    from asyncgrpo.inference.client import InferenceClient

    with InferenceClient(vllm_server.base_url) as c:
        yield c
