"""Real multi-process training: `accelerate launch` with 2 CPU processes (DDP, gloo) against the real server."""

import os
import re
import subprocess
import sys

import torch
from integration.runs import module_run
from safetensors.torch import load_file

PROMPT = [3 + b for b in b"23+19="]


# One launch for the whole module: its rewards are scored in two worker processes of rank 0 (`reward_workers: 2`), a
# reward that costs 1 ms of CPU per completion. Scoring on rank 0's own threads is what every other 2-process run here
# does (test_checkpoint.py, test_rollout_process.py).
two_process_run = module_run("ddp", "--max_steps", "4", "--per_device_train_batch_size", "32",
                             "--max_staleness", "1", "--learning_rate", "5e-3", "--reward_workers", "2",
                             "--reward_funcs", "[asyncgrpo.toy.task:slow_larger_reward]",
                             "--reward_kwargs", "{slow_larger_reward: {ms_per_completion: 1}}")


def test_two_processes_train_and_publish_every_step(two_process_run, client, tb_scalars):
    out, summary, proc = two_process_run
    assert summary["steps"] == 4 and summary["version"] == 4
    assert [v for _, v in tb_scalars(out / "tensorboard", "policy/version")] == [1.0, 2.0, 3.0, 4.0]
    assert client.adapter_paths()[summary["adapter_name"]] == summary["adapter_path"]
    trained = load_file(f"{summary['adapter_path']}/adapter_model.safetensors")
    b_max = [t.abs().max().item() for k, t in trained.items() if "lora_B" in k]
    assert len(b_max) == 2 * 7 and min(b_max) > 0  # every module's B moved away from its zero init
    assert "asyncgrpo: 100%" in proc.stderr  # rank 0's progress bar ran to the end
    assert proc.stderr.count("asyncgrpo.trainer.recipe: done") == 1  # one summary, from rank 0 only


def test_staleness_is_bounded_in_a_real_run(two_process_run, tb_scalars):
    out, summary, _ = two_process_run
    maxima = [v for _, v in tb_scalars(out / "tensorboard", "staleness/max")]
    assert len(maxima) == 4 and max(maxima) <= 1.0
    assert maxima[0] == 0.0  # the first batch can only come from version 0


def test_the_written_adapter_gives_the_served_logprobs(two_process_run, client, peft_logprobs):
    """Load the last published adapter with PEFT onto the unsharded base: its logprobs equal the server's."""
    _, summary, _ = two_process_run
    completion = client.complete(summary["adapter_name"], PROMPT, n=1, max_tokens=4, temperature=1.0)[0]
    mine = peft_logprobs(summary["adapter_path"], PROMPT, completion.token_ids)
    assert torch.allclose(mine, torch.tensor(completion.logprobs), atol=1e-3, rtol=0)


def test_reward_workers_score_a_two_process_run_and_stop_with_it(two_process_run, tb_scalars):
    """`reward_workers: 2`: rank 0 scores in two spawned worker processes; the run trains, logs its rewards, and
    leaves no worker behind."""
    out, _, proc = two_process_run
    (pids,) = re.findall(r"reward scoring in 2 worker processes \(pids (\d+ \d+)\)", proc.stderr)  # rank 0 only
    rewards = [v for _, v in tb_scalars(out / "tensorboard", "train/reward")]
    assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards) and max(rewards) > 0.0
    assert [v for _, v in tb_scalars(out / "tensorboard", "reward/fallbacks_total")] == [0.0] * 4
    for pid in map(int, pids.split()):
        assert not os.path.exists(f"/proc/{pid}"), f"reward worker {pid} outlived the run"


def test_a_config_mistake_fails_before_any_work_with_the_field_and_fix(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: toy\nuse_lora: true\nnum_generation: 8\n")
    proc = subprocess.run([sys.executable, "-m", "asyncgrpo", "train", "--config", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "config `num_generation`: unknown key. Fix: did you mean `num_generations`?" in proc.stderr
