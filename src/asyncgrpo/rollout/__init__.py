"""What one process runs for a run (rank 0, a spawned child, or `asyncgrpo rollout-serve`): servers, producer,
scheduler, queue, scoring, publishing. Its interface to the trainer is `interface.RolloutInterface`."""
