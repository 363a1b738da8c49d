"""`rollout_mode: stream` on the in-process HTTP stub servers (conftest.py): a real producer, clients, queue and scorer
sending to two servers while the served version moves, as the trainer takes batches. The stub stands in for vLLM so
that every answer is immediate and known; the send rule itself is pinned step by step in test_admission.py, and
tests/integration/test_stream.py trains in this mode against a real server."""

from __future__ import annotations

DEADLINE_S = 15.0


def test_stream_across_two_servers_trains_each_batch_within_the_bound_and_accounts_for_every_group(rollout_on_stub):
    rollout = rollout_on_stub(servers=2, groups_per_step=2, rollout_mode="stream", max_staleness=1,
                              max_inflight_requests=4)
    producer, queue = rollout.producer, rollout.queue
    producer.start()
    taken = []
    for version in range(4):  # the trainer publishes `version`, then takes its batch at that version
        producer.set_policy(version, f"demo-v{version}")
        batch = queue.take(2, trainer_version=version, timeout_s=DEADLINE_S)
        assert all(0 <= version - g.version <= 1 for g in batch), [(g.index, g.version) for g in batch]
        taken += [g.index for g in batch]
    producer.stop()
    assert len(set(taken)) == 8  # no group trained twice
    sent = sum(producer.sent_per_server().values())
    assert all(n > 0 for n in producer.sent_per_server().values())  # both servers generated
    # Every group sent is trained, dropped as too old, or still pending (in flight or queued): none vanishes.
    with producer.admission.cond:
        pending = producer.admission.pending
    assert sent == len(taken) + queue.dropped_stale + pending
    assert pending <= producer.admission.capacity == (1 + 1) * 2
