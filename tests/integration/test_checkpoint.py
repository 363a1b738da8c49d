"""Checkpoint and resume with real 2-process DDP launches (`accelerate launch`, gloo) against the real vLLM server.

Run A trains uninterrupted (the session's DDP reference run, 8 steps, which test_shutdown.py resumes against too). Run
B saves every 3 steps, is killed with SIGKILL (its whole process group, as a preempted node would be) once
checkpoint-3 exists, and is resumed with `--resume_from_checkpoint latest` to step 6.
One test, two launches of its own (~10 s each on an idle 2-core machine, plus the session server).
With `max_staleness: 0` and `seeded_generation: true` both runs sample the same completions from the same policies,
so B's final adapter must equal A's version 6, and its TensorBoard steps must run 1..6 with none lost or repeated. Every run
warms the learning rate up over 4 steps (0, 1/4, 1/2, 3/4 of it, then all of it): a resumed run whose schedule
restarted would take steps 3 and 4 at other rates. B's checkpoint-6 is also what a TRL user opens: it loads with
`PeftModel.from_pretrained` (through its model card's own snippet), and its trainer_state.json spans the kill.
The same holds on FSDP1, FSDP2, ZeRO-2 and ZeRO-3, whose LoRA weights (or their fp32 masters) and Adam state are
sharded (shorter runs with packed micro-batches, no kill: what is tested there is that the sharded state goes into the
checkpoint and back into the shards exactly). Their uninterrupted run is the session's sharded reference run, whose
publishing test_backends.py checks: two launches of their own per backend.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from integration.runs import (DDP_REFERENCE_STEPS, PACKED, REFERENCE_STEPS, REPO, SHARDED_BACKENDS, run_launch,
                              train_command, version_dir)
from safetensors.torch import load_file
from transformers import TrainerState

from asyncgrpo.bench.sync import cpu_launch_env

CHECKPOINT_DEADLINE_S = 300  # a launch reaches step 3 in ~15 s on 2 cores; generous for a loaded CI machine


def start_and_kill_after_checkpoint(cmd: list[str], out: Path) -> None:
    """Start a run, poll for checkpoint-3's manifest, then SIGKILL every process of the launch at once."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_launch_env("ddp"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + CHECKPOINT_DEADLINE_S
    manifest = out / "checkpoint-3" / "manifest.json"
    try:
        while not manifest.exists():
            assert proc.poll() is None, f"run B ended before checkpoint-3: {proc.stderr.read()[-5000:]}"
            assert time.monotonic() < deadline, f"no {manifest} after {CHECKPOINT_DEADLINE_S} s"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()


def test_killed_run_resumes_to_the_same_adapter_with_continuous_steps(world, vllm_server, client, tb_scalars,
                                                                      ddp_reference, tmp_path):
    a_out, a = ddp_reference  # uninterrupted, never saved, every version kept
    assert DDP_REFERENCE_STEPS >= 6

    b_out = tmp_path / "b"
    # max_steps only bounds the loop (steps 1-3 are the same): with 1000 the run cannot end before the kill.
    start_and_kill_after_checkpoint(train_command(b_out, vllm_server.base_url, "--save_steps", "3",
                                                  "--max_steps", "1000"), b_out)
    assert not (b_out / "run_summary.json").exists()
    manifest = json.loads((b_out / "checkpoint-3" / "manifest.json").read_text())
    saved = {"optimizer.pt", "scheduler.pt", "rng-rank0.pt", "rng-rank1.pt", "adapter_model.safetensors",
             "adapter_config.json", "trainer_state.json", "README.md"}
    assert saved <= set(manifest["files"])  # rank 1 wrote its own RNG state into rank 0's temporary directory
    killed = manifest["state"]
    assert (killed["step"], killed["version"], killed["data_position"]) == (3, 3, 3 * 4)  # 4 groups per step
    # The resumed run also evaluates once, after its last step, on 16 held-out prompts (all of them would need a
    # ddp_timeout of ~1400 s): its figures reach checkpoint-6's trainer_state.json and model card; training is not
    # touched.
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(world.heldout_file.read_text().splitlines(keepends=True)[:16]))
    b = run_launch(train_command(b_out, vllm_server.base_url, "--save_steps", "3", "--resume_from_checkpoint",
                                 "latest", "--eval_strategy", "steps", "--eval_steps", "6", "--eval_dataset",
                                 str(held_out)))

    # Step and version counters continue; the resumed run publishes under its own run id, the killed one's
    # adapters are gone from the server, and the server serves B's final version.
    assert (b["start_step"], b["steps"], b["version"]) == (3, 6, 6)
    assert b["resumed_from"] == str(b_out / "checkpoint-3")
    assert b["adapter_name"].endswith("-v6") and killed["run_id"] not in b["adapter_name"]
    served = client.adapter_paths()
    assert served[b["adapter_name"]] == b["adapter_path"]
    assert not [name for name in served if killed["run_id"] in name]

    # The uninterrupted run's adapter after step 6, and it moved since the checkpoint.
    final_a = load_file(version_dir(a, 6) / "adapter_model.safetensors")
    final_b = load_file(f"{b['adapter_path']}/adapter_model.safetensors")
    at_3 = load_file(f"{b_out}/checkpoint-3/adapter_model.safetensors")
    assert set(final_a) == set(final_b) and len(final_a) == 28
    assert max((final_a[k] - final_b[k]).abs().max().item() for k in final_a) < 1e-5
    assert max((final_b[k] - at_3[k]).abs().max().item() for k in final_b) > 1e-3
    saved_6 = load_file(f"{b_out}/checkpoint-6/adapter_model.safetensors")
    assert all(torch.equal(saved_6[k], final_b[k]) for k in final_b)
    check_trl_outputs(b_out, b, saved_6, held_out)

    # TensorBoard: steps 1..6 once each (what the killed run logged after step 3 is purged), the same batches.
    loss_a = tb_scalars(a_out / "tensorboard", "train/loss")[:6]
    loss_b = tb_scalars(b_out / "tensorboard", "train/loss")
    assert [s for s, _ in loss_b] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in tb_scalars(b_out / "tensorboard", "policy/version")] == [1, 2, 3, 4, 5, 6]
    reward_a = tb_scalars(a_out / "tensorboard", "train/reward")[:6]
    assert tb_scalars(b_out / "tensorboard", "train/reward") == reward_a  # the same completions were sampled
    assert max(abs(va - vb) for (_, va), (_, vb) in zip(loss_a, loss_b)) < 1e-5
    rates = [v for _, v in tb_scalars(b_out / "tensorboard", "train/learning_rate")]
    assert rates == pytest.approx([0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])  # the warm-up continued after the resume


def check_trl_outputs(out: Path, summary: dict, saved_6: dict, held_out: Path) -> None:
    """What a TRL user reads from run B: checkpoint-6 loads with PeftModel.from_pretrained (by its model card's own
    snippet) as the adapter saved; its trainer_state.json has the whole run's log_history, across the kill."""
    card = (out / "checkpoint-6" / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0]
    namespace: dict = {}
    exec(snippet, namespace)  # noqa: S102 - the card's how-to-load, run as a user would
    from peft import PeftModel, get_peft_model_state_dict

    model = namespace["model"]
    assert isinstance(model, PeftModel) and model.peft_config["default"].base_model_name_or_path == \
        summary["model_path"]
    loaded = get_peft_model_state_dict(model)
    assert set(loaded) == set(saved_6) and all(torch.equal(loaded[k], saved_6[k]) for k in saved_6)
    assert "- **Steps:** 6 optimizer steps of 6 (policy version 6)" in card
    assert f"| `eval_reward` | {summary['eval/reward']:.4f} |" in card and f"on `{held_out}`" in card
    state = TrainerState.load_from_json(str(out / "checkpoint-6" / "trainer_state.json"))
    assert state.global_step == 6 and state.max_steps == 6
    assert [e["step"] for e in state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]  # steps 1-3: the killed run
    assert [(e["step"], e["eval_reward"]) for e in state.log_history if "eval_reward" in e] == \
        [(6, summary["eval/reward"])]
    final_card = (out / "README.md").read_text()  # the final adapter's: the same figures, its own path
    assert final_card.split("## Last evaluation")[1] == \
        card.split("## Last evaluation")[1].replace(str((out / "checkpoint-6").resolve()), str(out.resolve()))


@pytest.mark.parametrize("backend", SHARDED_BACKENDS)
def test_sharded_run_resumes_its_sharded_state_to_the_same_adapter(backend, vllm_server, sharded_reference, tmp_path):
    """FSDP and ZeRO shard the LoRA weights (ZeRO-2: their fp32 masters) and their Adam state: a run resumed from
    checkpoint-2 must take step 3 exactly as an uninterrupted run does (same weights, same optimizer moments), so
    the final adapters agree."""
    assert REFERENCE_STEPS == 3
    _, a = sharded_reference(backend)  # 3 steps, never saved
    b_out = tmp_path / "b"
    first = run_launch(train_command(b_out, vllm_server.base_url, "--max_steps", "2", "--save_steps", "2", *PACKED,
                                     backend=backend))
    b = run_launch(train_command(b_out, vllm_server.base_url, "--max_steps", "3", "--resume_from_checkpoint", "latest",
                                 *PACKED, backend=backend))
    assert (b["start_step"], b["steps"], b["version"], b["backend"]) == (2, 3, 3, backend)
    saved = load_file(str(b_out / "checkpoint-2" / "adapter_model.safetensors"))
    republished = load_file(str(Path(b["adapter_path"]).parent / "v000002" / "adapter_model.safetensors"))
    assert all(torch.equal(saved[k], republished[k]) for k in saved)  # weights went back into the shards exactly
    if backend.startswith("zero"):  # DeepSpeed's own files hold the LoRA weights but no base layer weights; the
        files = sorted((b_out / "checkpoint-2" / "deepspeed" / "state").glob("*model_states.pt"))  # ZeRO-3: per rank
        states = torch.load(files[0], weights_only=False)["module"]  # tied lm_head alias of the embedding: kept
        assert sum("lora_" in k for k in states) == len(saved)
        assert [k for k in states if "lora_" not in k] == ["base_model.model.lm_head.weight"]
    # The schedule reaches the optimizer this backend steps: step 1 ran at learning rate 0 (warm-up), step 2 did not.
    versions = [load_file(str(Path(first["adapter_path"]).parent / f"v00000{v}" / "adapter_model.safetensors"))
                for v in range(3)]
    assert all(torch.equal(versions[0][k], versions[1][k]) for k in saved)
    assert max((versions[2][k] - versions[1][k]).abs().max().item() for k in saved) > 1e-4
    final_a = load_file(f"{a['adapter_path']}/adapter_model.safetensors")
    final_b = load_file(f"{b['adapter_path']}/adapter_model.safetensors")
    assert max((final_a[k] - final_b[k]).abs().max().item() for k in final_a) <= 1e-5
    assert max((final_b[k] - saved[k]).abs().max().item() for k in saved) > 1e-3  # step 3 really moved it
