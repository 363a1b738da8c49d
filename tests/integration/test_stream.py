"""`rollout_mode: stream` against the session's real vLLM server: a 2-process run (DDP, gloo) whose rollout side
runs in a child process, with completions moved onto each new version mid-generation, trains within its staleness
bound, is checkpointed, and resumes from the checkpoint in the same mode to the step it was given."""

STREAM = ("--rollout_mode", "stream", "--max_staleness", "1", "--inflight_weight_updates", "true",
          "--rollout_process", "true", "--per_device_train_batch_size", "32", "--learning_rate", "5e-3")


def test_a_stream_run_trains_within_the_bound_and_resumes_from_its_checkpoint(train_two_processes, tmp_path,
                                                                               tb_scalars):
    out = tmp_path / "stream"
    first, _ = train_two_processes(out, *STREAM, "--max_steps", "2", "--save_steps", "2")
    assert (first["steps"], first["version"]) == (2, 2)
    resumed, proc = train_two_processes(out, *STREAM, "--max_steps", "4", "--resume_from_checkpoint", "latest")
    assert (resumed["start_step"], resumed["steps"], resumed["version"]) == (2, 4, 4)
    assert [v for _, v in tb_scalars(out / "tensorboard", "policy/version")] == [1.0, 2.0, 3.0, 4.0]
    staleness = [v for _, v in tb_scalars(out / "tensorboard", "staleness/max")]
    assert len(staleness) == 4 and all(0 <= s <= 1 for s in staleness)  # no group older than max_staleness trained
    # The mode reached the rollout process: its counters of moved completions were written beside the trainer's.
    assert len(tb_scalars(out / "tensorboard", "rollout/inflight_continuations_total")) == 4
