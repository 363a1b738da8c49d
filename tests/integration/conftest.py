"""The integration session's real vLLM CPU servers on the toy world's base model (one, and a second for the tests of
several servers, started side by side), and the helpers its tests share."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_HERE = Path(__file__).parent


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


START_S = 600  # a vLLM CPU start takes ~30 s on 2 quiet cores; 180 s was not enough with load 11 on them
USES_SECOND = pytest.StashKey[bool]()


def pytest_collection_finish(session):
    """Whether the tests selected use the second server (then it starts beside the first one)."""
    session.config.stash[USES_SECOND] = any("second_vllm_server" in getattr(item, "fixturenames", ())
                                            for item in session.items)


def _server(world, tmp_path_factory, name: str, max_lora_rank: int):
    """A real vLLM CPU server on the toy model, not started yet."""
    from asyncgrpo.inference_node.vllm_server import find_free_port
    from integration.runs import make_server

    log = tmp_path_factory.mktemp(name) / "vllm.log"
    return make_server(world.model_dir, find_free_port(), max_lora_rank=max_lora_rank, max_loras=4, max_model_len=256,
                       log_path=log)


def _ready(server):
    """`server` started if it is not yet, health-polled, then stopped at the end of the session."""
    try:
        if server.process is None:
            server.start()
        server.wait_ready(START_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _second_server(world, tmp_path_factory):
    """The second server, started by whichever of the two session servers comes first; stopped at the end."""
    server = _server(world, tmp_path_factory, "vllm2", max_lora_rank=16)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server(world, tmp_path_factory, request):
    server = _server(world, tmp_path_factory, "vllm", max_lora_rank=8)
    server.start()
    if request.config.stash.get(USES_SECOND, False):
        # A vLLM start is one Python process at a time: two side by side on 2 cores take about as long as one.
        second = request.getfixturevalue("_second_server")
        if second.process is None:
            second.start()
    yield from _ready(server)


@pytest.fixture(scope="session")
def second_vllm_server(_second_server):
    """A second inference server, only for the several-servers tests; it accepts rank 16 where the first does not."""
    yield from _ready(_second_server)


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
def ddp_reference(vllm_server, tmp_path_factory):
    """(output_dir, run summary) of one uninterrupted DDP `train_command` run of DDP_REFERENCE_STEPS steps that keeps
    every adapter version: test_checkpoint.py's killed run and test_shutdown.py's SIGTERMed run, each resumed, must end
    at its version of their last step."""
    from integration.runs import DDP_REFERENCE_STEPS, run_launch, train_command

    out = tmp_path_factory.mktemp("reference-ddp")
    steps = str(DDP_REFERENCE_STEPS)
    return out, run_launch(train_command(out, vllm_server.base_url, "--max_steps", steps, "--keep_adapter_versions",
                                         steps))


@pytest.fixture(scope="session")
def sharded_reference(vllm_server, tmp_path_factory):
    """`sharded_reference(backend) -> (output_dir, run summary)`: one uninterrupted `train_command` run of
    REFERENCE_STEPS steps with PACKED on a sharded backend, launched the first time a session asks for that backend.
    test_backends.py checks what it published; test_checkpoint.py resumes a run of the same config and compares."""
    from integration.runs import PACKED, REFERENCE_STEPS, run_launch, train_command

    runs = {}

    def get(backend: str):
        if backend not in runs:
            out = tmp_path_factory.mktemp(f"reference-{backend}")
            runs[backend] = out, run_launch(train_command(out, vllm_server.base_url, "--max_steps",
                                                          str(REFERENCE_STEPS), *PACKED, backend=backend))
        return runs[backend]

    return get


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
