"""One real vLLM CPU server for the whole integration session, serving the toy world's base model."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_HERE = Path(__file__).parent
# A toy server is ready in ~30 s on an idle machine; on a shared 2-core one with other servers starting, over 180 s.
READY_S = 600.0


def pytest_collection_modifyitems(config, items):
    """Every test in this directory is `integration` (real vLLM server, real launches), so that
    `pytest -m "not integration"` (make test-unit) runs the fast tier alone. The hook sees the whole session's items:
    mark only ours."""
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def world():
    from asyncgrpo.toy import build_toy_world

    return build_toy_world()


def _serve(world, tmp_path_factory, name: str, max_lora_rank: int):
    """A real vLLM CPU server on the toy model for the rest of the session (started, health-polled, stopped)."""
    from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port

    log = tmp_path_factory.mktemp(name) / "vllm.log"
    server = VLLMServer(world.model_dir, find_free_port(), max_lora_rank=max_lora_rank, max_loras=4, max_model_len=256,
                        log_path=log)
    try:
        server.start()
        server.wait_ready(timeout_s=READY_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(world, tmp_path_factory):
    yield from _serve(world, tmp_path_factory, "vllm", max_lora_rank=8)


@pytest.fixture(scope="session")
def second_vllm_server(world, tmp_path_factory):
    """A second inference server, only for the several-servers tests; it accepts rank 16 where the first does not."""
    yield from _serve(world, tmp_path_factory, "vllm2", max_lora_rank=16)


@pytest.fixture()
def client(vllm_server):
    from asyncgrpo.inference.client import InferenceClient

    with InferenceClient(vllm_server.base_url) as c:
        yield c


@pytest.fixture(scope="session")
def random_adapter(world):
    """`random_adapter(seed) -> (tensors, peft config)`: a LoRA with random non-zero weights on the toy model."""

    def make(seed: int, rank: int = 8):
        import torch
        from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                            init_lora_weights=False)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(world.model_dir), config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.3)
        return get_peft_model_state_dict(model), config

    return make


@pytest.fixture(scope="session")
def train_two_processes(vllm_server):
    """`train_two_processes(out, *overrides) -> (run summary, finished process)`: `asyncgrpo train` launched on 2 gloo
    ranks (configs/demo.yaml) against the session server, writing to `out`; a failed launch fails the test with its
    stderr."""
    import json
    import subprocess

    from asyncgrpo.demo import default_config_path, launch_command, launch_environment
    from asyncgrpo.inference_node.vllm_server import find_free_port

    def run(out: Path, *overrides: str):
        args = ["--output_dir", str(out), "--lora_adapter_path", str(out / "adapters"),
                "--vllm_server_base_url", vllm_server.base_url, "--ddp_timeout", "200", "--vllm_server_timeout", "30",
                "--vllm_request_timeout", "40", *overrides]
        cmd = launch_command(2, find_free_port(), default_config_path(), args)
        proc = subprocess.run(cmd, env=launch_environment(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads((out / "run_summary.json").read_text()), proc

    return run


@pytest.fixture(scope="session")
def tb_scalars():
    """`tb_scalars(tensorboard_dir, tag) -> [(step, value), ...]`, read back from the event files."""

    def read(tb_dir, tag):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tb_dir))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    return read


@pytest.fixture(scope="session")
def peft_logprobs(world):
    """`peft_logprobs(adapter_dir, prompt_ids, completion_ids)`: the completion tokens' logprobs (fp32) with the
    adapter loaded by PEFT onto the unsharded toy base, the reference a served adapter is compared with."""

    def score(adapter_dir, prompt_ids, completion_ids):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(world.model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        return logprobs[len(prompt_ids) - 1:].gather(-1, ids[0, len(prompt_ids):, None]).squeeze(-1)

    return score
