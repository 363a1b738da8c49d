"""One run against the session's real vLLM server reports to TensorBoard, wandb (offline) and trackio (local) at
once, with `log_completions` and an evaluation every 2 steps, its rollout side in a child process (no accelerate
state there); each tracker and `completions.jsonl` are read back from their own files and agree."""

import json
import re

import pytest
from integration.runs import DEADLINE_S, train
from trackers_read import trackio_logs, wandb_history, wandb_run_dir

STEPS, ROWS = 4, 4  # 4 optimizer steps; 4 completions per table


def same_series(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    """The same steps and, to float32 precision (TensorBoard's), the same values."""
    return [s for s, _ in got] == [s for s, _ in expected] and \
        [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


@pytest.fixture(scope="module")
def tracked_run(world, vllm_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("trackers")
    heldout = out / "heldout.jsonl"
    heldout.write_text("".join(world.heldout_file.read_text().splitlines(keepends=True)[:8]))
    proc = train(vllm_server.base_url, out, "--rollout_process", "true", "--max_steps", str(STEPS),
                 "--logging_steps", "1", "--report_to", "tensorboard,wandb,trackio", "--log_completions", "true",
                 "--num_completions_to_print", str(ROWS), "--eval_strategy", "steps", "--eval_steps", "2",
                 "--eval_dataset", str(heldout), "--num_generations_eval", "2",
                 env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(out / "trackio")})
    assert proc.wait(timeout=DEADLINE_S) == 0, (out / "train.log").read_text()[-4000:]
    return out, json.loads((out / "run_summary.json").read_text())


def test_tensorboard_holds_the_trl_names_the_evaluation_and_the_completions_text(tracked_run, tb_scalars):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, summary = tracked_run
    assert [s for s, _ in tb_scalars(out / "tensorboard", "train/reward")] == [1, 2, 3, 4]
    assert [s for s, _ in tb_scalars(out / "tensorboard", "train/completions/mean_length")] == [1, 2, 3, 4]
    evals = tb_scalars(out / "tensorboard", "eval/reward")
    assert [s for s, _ in evals] == [2, 4] and all(0.0 <= v <= 1.0 for _, v in evals)
    assert summary["eval/reward"] == pytest.approx(evals[-1][1])  # the last evaluation is in the summary
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors("completions/text_summary")] == [1, 2, 3, 4]


def test_wandb_offline_run_holds_every_step_the_evaluation_and_a_table_per_step(tracked_run, tb_scalars):
    out, _ = tracked_run
    rows = wandb_history(wandb_run_dir(out))
    reward = [(r["train/global_step"], r["train/reward"]) for r in rows if "train/reward" in r]
    assert same_series(reward, tb_scalars(out / "tensorboard", "train/reward"))  # the same values at each step
    assert [r["train/global_step"] for r in rows if "eval/reward" in r] == [2, 4]
    tables = [r for r in rows if "completions/_type" in r]
    assert [(t["train/global_step"], t["completions/nrows"]) for t in tables] == [(s, ROWS) for s in range(1, 5)]


def test_trackio_holds_every_step_the_evaluation_and_the_completions(tracked_run, tb_scalars):
    out, summary = tracked_run
    logs = trackio_logs(out / "trackio", "asyncgrpo")
    run_id = summary["adapter_name"].split("-")[-2]  # <lora_name>-<run id>-v<N>
    assert {name for name, _, _ in logs} == {f"{out.name}-{run_id}"}  # the default run_name
    reward = [(step, m["train/reward"]) for _, step, m in logs if "train/reward" in m]
    assert same_series(reward, tb_scalars(out / "tensorboard", "train/reward"))
    assert [step for _, step, m in logs if "eval/reward" in m] == [2, 4]
    tables = [(step, m["completions"]["_value"]) for _, step, m in logs if "completions" in m]
    lines = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [step for step, _ in tables] == [1, 2, 3, 4]
    assert [row for _, table in tables for row in table] == lines  # trackio's tables are the file's rows


def test_completions_jsonl_rows_are_the_scored_completions(tracked_run):
    out, _ = tracked_run
    lines = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [s for s in range(1, STEPS + 1) for _ in range(ROWS)]
    for row in lines:
        a, b = re.fullmatch(r"(\d\d),(\d\d)>", row["prompt"]).groups()
        # The decoded text is what the reward judged: 1.0 exactly for the larger operand.
        assert row["larger_reward"] == (1.0 if row["completion"].strip() == max(a, b) else 0.0), row
        assert row["reward"] == row["larger_reward"]  # the only function, weight 1
        assert row["advantage"] * (row["reward"] - 0.5) >= 0  # above its group's mean when right, below when wrong
