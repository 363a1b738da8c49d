"""The doctor's server checks: each failure's line names the value and the fix. `FakeVLLM` (tests/fakes.py) answers
what a real server would (tests/integration/test_faults.py runs `asyncgrpo doctor` against real servers)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fakes import FakeVLLM

from asyncgrpo.rollout.preflight import check_adapter_dir_writable, report
from asyncgrpo.inference.checks import (CheckResult, ServerContext, check_base_model, check_dev_mode,
                                        check_lora_enabled, check_max_lora_rank, check_max_loras,
                                        check_runtime_lora_updating, check_version)

NODE = "http://node:8000"


def ctx(client, model_path="/models/m", **cfg):
    values = dict(lora_r=8, max_staleness=1, sync_mode="pause", lora_adapter_path="/tmp")
    values.update(cfg)
    return ServerContext(SimpleNamespace(**values), client, model_path)


def test_rank_and_max_loras_failures_name_the_server_flag():
    client = FakeVLLM(NODE, lora={"max_lora_rank": 8, "max_loras": 2})
    assert check_max_lora_rank(ctx(client, lora_r=16)).line() == (
        "FAIL  max_lora_rank: --max-lora-rank 8 is below lora_r=16. Fix: restart it with --max-lora-rank 16 (vLLM "
        "accepts 1, 8, 16, 32, 64, ...), or lower lora_r")
    assert check_max_loras(ctx(client, max_staleness=1)).line() == (
        "FAIL  max_loras: --max-loras 2, but this run may serve 3 adapter versions at once (max_staleness + 2). "
        "Fix: restart it with --max-loras 3, or lower max_staleness")
    assert check_max_loras(ctx(client, max_staleness=0)).ok is True


def test_lora_off_and_no_server_info_are_told_apart():
    assert check_lora_enabled(ctx(FakeVLLM(NODE, lora=None))).line() == (
        "FAIL  LoRA enabled: the server serves no LoRA adapters. Fix: restart it with --enable-lora "
        "--max-lora-rank 8 --max-loras 3")
    skipped = check_max_lora_rank(ctx(FakeVLLM(NODE, dev_mode=False)))
    assert skipped.ok is None and "no /server_info (VLLM_SERVER_DEV_MODE unset)" in skipped.line()


def test_dev_mode_is_required_only_for_pause_sync():
    no_dev = FakeVLLM(NODE, lora={}, dev_mode=False)
    assert check_dev_mode(ctx(no_dev, sync_mode="pause")).line() == (
        "FAIL  dev mode: sync_mode: pause needs /pause and /resume, and the server has neither. Fix: start it with "
        "VLLM_SERVER_DEV_MODE=1 (launch/vllm/serve.sh and `python -m asyncgrpo.inference_node.vllm_server` set it), or set "
        "sync_mode: versioned")
    assert check_dev_mode(ctx(no_dev, sync_mode="versioned")).ok is True


def test_runtime_lora_updating_and_version():
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in check_runtime_lora_updating(
        ctx(FakeVLLM(NODE, lora_updating=False))).fix
    assert check_version(ctx(FakeVLLM(NODE, vllm_version="0.9.1"))).line() == (
        "FAIL  vLLM version: 0.9.1 is older than 0.10.2. Fix: upgrade vLLM on the inference node")
    assert check_version(ctx(FakeVLLM(NODE, vllm_version="0.32.0+cpu"))).ok is True


def _model(directory, **config):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 2, **config}))
    return str(directory)


def test_base_model_matches_by_directory_then_config_then_name(tmp_path):
    served = _model(tmp_path / "server" / "qwen", _name_or_path="x")
    same_config = _model(tmp_path / "trainer" / "copy", _name_or_path="y", transformers_version="5")
    other = _model(tmp_path / "trainer" / "other", num_hidden_layers=4)
    assert check_base_model(ctx(FakeVLLM(NODE, root=served), served)).ok is True
    result = check_base_model(ctx(FakeVLLM(NODE, root=served), same_config))
    assert result.ok is True and "equal config.json" in result.detail
    result = check_base_model(ctx(FakeVLLM(NODE, root=served), other))
    assert result.ok is False and "differs from" in result.detail and "num_hidden_layers" in result.detail
    # Paths that are not readable here (the server's disk): only the name can be compared.
    by_name = check_base_model(ctx(FakeVLLM(NODE, root="/mnt/node/Qwen2.5-0.5B"), "Qwen/Qwen2.5-0.5B"))
    assert by_name.ok is True and "shapes not compared" in by_name.detail
    assert check_base_model(ctx(FakeVLLM(NODE, root="/mnt/node/Llama-3-8B"), "Qwen/Qwen2.5-0.5B")).line() == (
        "FAIL  base model: the server serves /mnt/node/Llama-3-8B, the trainer loads Qwen/Qwen2.5-0.5B. Fix: serve "
        "the trainer's base model (vLLM --model) or set model_name_or_path to the served one")


def test_an_unwritable_adapter_directory_fails_with_the_key_to_change(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = check_adapter_dir_writable(SimpleNamespace(lora_adapter_path=str(blocker / "adapters")))
    assert result.ok is False and result.fix.startswith("set lora_adapter_path to a writable directory")


@pytest.mark.parametrize("results,last", [([True, None], "all checks passed"), ([True, False, False],
                                                                             "2 check(s) failed")])
def test_report_groups_lines_by_server_and_counts_failures(results, last):
    text = report([("http://a", CheckResult(f"c{i}", ok, "d", "f")) for i, ok in enumerate(results)])
    assert text.splitlines()[0] == "http://a:" and text.splitlines()[-1] == last
