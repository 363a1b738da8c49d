"""What the rollout process runs (in rank 0, a spawned child, or `asyncgrpo rollout-serve`): the server pool,
producer, admission, queue, scoring, publishing. The trainer reaches it through `transport.interface.RolloutInterface`."""
