"""VLLMServer's command line and environment carry every flag LoRA hot reload needs; its process handling
reports start-up failures with the log and always ends the process. No vLLM is started here: the process tests
swap the command for a short Python one-liner."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from asyncgrpo.errors import ConfigError, InferenceServerError
from asyncgrpo.inference_node.vllm_server import VLLMServer
from asyncgrpo.inference_node.vllm_server import find_free_port
from asyncgrpo.inference_node.vllm_server import main as server_main


def flag(cmd: list[str], name: str) -> str:
    """The value that follows `name` in `cmd` (and `name` occurs once)."""
    assert cmd.count(name) == 1, f"{name} occurs {cmd.count(name)} times in {cmd}"
    return cmd[cmd.index(name) + 1]


def test_command_has_the_lora_hot_reload_flags_with_their_values():
    server = VLLMServer("/models/tiny", 8123, max_lora_rank=16, max_loras=3, max_model_len=1024, dtype="bfloat16")
    cmd = server.command()

    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(cmd, "--model") == "/models/tiny"
    assert flag(cmd, "--host") == "127.0.0.1"
    assert flag(cmd, "--port") == "8123"
    assert "--enable-lora" in cmd
    assert flag(cmd, "--max-lora-rank") == "16"
    assert flag(cmd, "--max-loras") == "3"
    assert flag(cmd, "--dtype") == "bfloat16"
    assert flag(cmd, "--max-model-len") == "1024"
    assert flag(cmd, "--logprobs-mode") == "processed_logprobs"
    assert "--max-num-batched-tokens" not in cmd


def test_command_defaults_batched_tokens_and_extra_args():
    cmd = VLLMServer(Path("/m"), 9000, max_num_batched_tokens=8192, extra_args=["--seed", "1"]).command()

    assert flag(cmd, "--model") == "/m"
    assert (flag(cmd, "--max-lora-rank"), flag(cmd, "--max-loras")) == ("8", "4")
    assert (flag(cmd, "--dtype"), flag(cmd, "--max-model-len")) == ("float32", "512")
    assert flag(cmd, "--max-num-batched-tokens") == "8192"
    assert flag(cmd, "--max-num-seqs") == "256"  # not vLLM CPU's 128: a 32 x 8 GRPO step in one wave
    assert cmd[-2:] == ["--seed", "1"]
    assert "--max-num-seqs" not in VLLMServer(Path("/m"), 9000, max_num_seqs=None).command()  # vLLM's own default


def test_environment_enables_adapter_and_dev_endpoints():
    env = VLLMServer("/m", 9000, kv_cache_gib=3).environment()

    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["DO_NOT_TRACK"] == "1"


def test_api_key_goes_through_the_environment_not_the_command_line(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    server = VLLMServer("/m", 9000, api_key="sk-secret")

    assert not any("sk-secret" in arg for arg in server.command())
    assert "--api-key" not in server.command()
    assert server.environment()["VLLM_API_KEY"] == "sk-secret"
    assert "VLLM_API_KEY" not in VLLMServer("/m", 9000).environment()


def test_caller_env_overrides_ours():
    env = VLLMServer("/m", 9000, env={"VLLM_CPU_KVCACHE_SPACE": "8", "OMP_NUM_THREADS": "1"}).environment()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8" and env["OMP_NUM_THREADS"] == "1"


def test_base_url_of_a_server_bound_to_all_interfaces_is_reached_on_loopback():
    assert VLLMServer("/m", 8000, host="0.0.0.0").base_url == "http://127.0.0.1:8000"
    assert VLLMServer("/m", 8001).base_url == "http://127.0.0.1:8001"


def test_find_free_port_returns_a_bindable_port():
    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def fake_server(tmp_path: Path, code: str) -> VLLMServer:
    """A VLLMServer whose process is `python -c code` on a port where nothing will listen."""
    server = VLLMServer("/m", find_free_port(), log_path=tmp_path / "server.log")
    server.command = lambda: [sys.executable, "-c", code]
    return server


def test_wait_ready_quotes_the_log_when_the_process_exits(tmp_path):
    server = fake_server(tmp_path, "import sys\nfor i in range(40): print('line', i)\nsys.exit(3)")
    server.start()
    with pytest.raises(InferenceServerError) as err:
        server.wait_ready(timeout_s=30)

    message = str(err.value)
    assert "exited with code 3" in message
    assert "line 39" in message and "line 10" in message and "line 9\n" not in message  # the last 30 lines
    server.stop()


def test_wait_ready_quotes_only_this_start_of_a_reused_log_file(tmp_path):
    (tmp_path / "server.log").write_text("output of an earlier run\n")
    server = fake_server(tmp_path, "import sys\nprint('this run failed')\nsys.exit(2)")
    server.start()
    with pytest.raises(InferenceServerError) as err:
        server.wait_ready(timeout_s=30)

    assert "this run failed" in str(err.value) and "earlier run" not in str(err.value)
    assert (tmp_path / "server.log").read_text().startswith("output of an earlier run")


def test_wait_ready_gives_up_at_the_deadline_with_the_log(tmp_path):
    server = fake_server(tmp_path, "import time\nprint('loading weights', flush=True)\ntime.sleep(60)")
    server.start()
    try:
        _wait_for_log(server, "loading weights")
        with pytest.raises(InferenceServerError, match=r"(?s)did not answer 200.*within 0.2 s.*loading weights"):
            server.wait_ready(timeout_s=0.2)
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_stop_kills_a_process_that_ignores_sigterm_and_is_idempotent(tmp_path):
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)"
    )
    server = fake_server(tmp_path, code)
    server.start()
    _wait_for_log(server, "ready")

    assert server.stop(grace_s=0.2) == -9
    assert server.stop() == -9
    assert VLLMServer("/m", 1).stop() is None  # never started


def _wait_for_log(server: VLLMServer, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.log_path.read_text():
        assert server.process.poll() is None, server.log_path.read_text()
        assert time.monotonic() < deadline, f"{text!r} never appeared in {server.log_path}"
        time.sleep(0.01)


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("ASYNCGRPO_ALLOW_KEYLESS", raising=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5"])
def test_a_keyless_server_beyond_loopback_is_refused_before_it_starts(no_key, host):
    server = VLLMServer("/m", 8000, host=host)
    with pytest.raises(ConfigError, match=r"`--host`: '.+' is not a loopback address and no API key") as err:
        server.start()
    assert err.value.field == "--host"
    assert "Fix: set VLLM_API_KEY" in str(err.value) and "--allow-keyless" in str(err.value)
    assert server.process is None
    assert server_main(["--model", "/m", "--host", host]) == 2  # the module's main, before anything starts


def test_a_key_loopback_or_an_explicit_allowance_lets_it_listen(no_key, monkeypatch):
    VLLMServer("/m", 8000, host="127.0.0.1").check_exposure()
    VLLMServer("/m", 8000, host="0.0.0.0", api_key="k" * 32).check_exposure()
    VLLMServer("/m", 8000, host="0.0.0.0", env={"VLLM_API_KEY": "k" * 32}).check_exposure()
    VLLMServer("/m", 8000, host="0.0.0.0", allow_keyless=True).check_exposure()
    monkeypatch.setenv("ASYNCGRPO_ALLOW_KEYLESS", "1")
    VLLMServer("/m", 8000, host="0.0.0.0").check_exposure()
