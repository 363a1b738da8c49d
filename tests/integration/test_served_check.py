"""The live served == trained check against the real vLLM server: a server that serves the base model, or the version
before, under the new version's name is caught at that sync; a correct run (fp32, and a bf16 trainer) never is.

The wrong servers are made by writing wrong files under the right version's directory (the server loads them as it
would a real version; its reported path matches, so the old path read-back passes): a zero adapter (LoRA B = 0, the
base model) or the previous version's tensors."""

import pytest
import torch

from asyncgrpo.errors import ServedPolicyError
from asyncgrpo.rollout.served_check import TOLERANCE
from asyncgrpo.trainer.recipe import GRPORecipe
from integration.runs import in_process_config

SABOTAGED = 3  # the version whose files are replaced


def _trainer(server, tmp_path, *overrides):
    cfg = in_process_config(server.base_url, tmp_path, "--max_steps", "5", "--per_device_train_batch_size", "64",
                            "--max_staleness", "0", "--torch_num_threads", "0", *overrides)
    return GRPORecipe(cfg)


def _write_instead(trainer, wrong):
    """From now on, version SABOTAGED's directory gets `wrong(tensors, previous tensors)` instead of its own."""
    store = trainer.rollout.parts.store
    write, written = store.write, {}

    def sabotaged(version, tensors, *args, **kwargs):
        written[version] = tensors
        if version == SABOTAGED:
            tensors = wrong(tensors, written[version - 1])
        return write(version, tensors, *args, **kwargs)

    store.write = sabotaged


def _run_until_caught(trainer) -> str:
    with pytest.raises(ServedPolicyError) as caught:
        trainer.train()
    # Caught at that version's sync: the trainer stopped before training on anything the wrong server sampled.
    assert trainer.step == SABOTAGED
    return str(caught.value)


def test_a_server_serving_the_base_under_the_new_name_is_caught_at_that_sync(vllm_server, tmp_path):
    trainer = _trainer(vllm_server, tmp_path)
    try:
        trainer.setup()
        _write_instead(trainer, lambda tensors, _: {k: torch.zeros_like(v) if "lora_B" in k else v
                                                    for k, v in tensors.items()})
        message = _run_until_caught(trainer)
    finally:
        trainer.cleanup()
    assert vllm_server.base_url in message and f"policy version {SABOTAGED}" in message
    assert "They match the base model" in message, message


def test_a_server_serving_the_previous_version_under_the_new_name_is_caught_at_that_sync(vllm_server, tmp_path):
    trainer = _trainer(vllm_server, tmp_path)
    try:
        trainer.setup()
        _write_instead(trainer, lambda _, previous: previous)
        message = _run_until_caught(trainer)
    finally:
        trainer.cleanup()
    assert vllm_server.base_url in message and f"policy version {SABOTAGED}" in message
    assert f"They match version {SABOTAGED - 1}, an older adapter" in message, message


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_correct_run_is_checked_at_every_sync_and_never_stopped(vllm_server, tmp_path, dtype):
    trainer = _trainer(vllm_server, tmp_path, "--torch_dtype", dtype)
    diffs, moved = [], []
    try:
        trainer.setup()
        check = trainer.rollout.parts.publisher.served_check
        verify, expect = check.verify, check.expect
        check.verify = lambda *a: diffs.append(verify(*a)) or diffs[-1]
        check.expect = lambda *a: moved.append(expect(*a)) or moved[-1]
        trainer.train()
    finally:
        trainer.cleanup()
    # Versions 1..5 each checked (version 0, published before any batch fixed the probe, is not).
    assert len(diffs) == 5 and len(moved) == 5
    steps = [m for m in moved if m is not None]
    print(f"{dtype}: served - trained max |logprob diff| per version {diffs}; one step moved the probe by {steps}")
    assert max(diffs) <= TOLERANCE[dtype]
    if dtype == "float32":  # each step moves the probe beyond the bound (10x in two runs): one step old is told apart
        assert min(steps) > TOLERANCE[dtype]
