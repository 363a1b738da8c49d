"""How the producer hands a server that stopped answering to the server recovery (inference/recovery.py, whose own
rules are in tests/unit/inference/test_recovery.py), waits while every server is down, and hands its own failures to
the trainer. The stub HTTP server stands in for vLLM: a real one cannot be made to drop exactly these requests on
demand (tests/integration/test_faults.py kills a real server, with whatever requests are in flight then)."""

import json
import threading
import time

import pytest
from fakes import generation

from asyncgrpo.data import PromptRow
from asyncgrpo.errors import AdapterNotLoadedError, InferenceServerError, ServerUnreachableError
from asyncgrpo.inference.recovery import ServerRecovery

DEADLINE_S = 15.0


class RecordingRecovery(ServerRecovery):  # not a fakes.py fake: the real recovery, recording what it is handed
    """The real recovery, recording what the producer hands it (the cause itself only reaches a log line)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed = []

    def recover(self, client, seen_epoch, cause=None):
        self.handed.append((client, seen_epoch, cause))
        return super().recover(client, seen_epoch, cause)


def test_a_lost_request_hands_its_server_and_the_cause_to_recovery_which_restores_it(rollout_on_stub):
    restored = []
    recovery = RecordingRecovery(30, restore=restored.append)
    dropped = []

    @generation
    def route(body):
        if not dropped:
            dropped.append(body["prompt"])
            return None  # the server dies under the first request: no answer at all
        return rollout_on_stub.answer(body, [[7]] * body["n"])

    rollout = rollout_on_stub(route, recovery=recovery)
    groups = rollout.run()
    deadline = time.monotonic() + DEADLINE_S
    while recovery.recoveries < 1:  # the resent prompt may be answered before the recovery thread is done
        assert time.monotonic() < deadline, "the server was never recovered"
        time.sleep(0.005)
    ((client, seen_epoch, cause),) = recovery.handed
    assert client is rollout.client and seen_epoch == 0  # the epoch read before the request was sent
    assert isinstance(cause, ServerUnreachableError) and rollout.server.url in str(cause)
    assert restored == [rollout.client]  # the current adapter put back before it gets requests again
    assert recovery.is_up(rollout.client) and recovery.epoch(rollout.client) == 1
    assert sorted(g.index for g in groups) == [0, 1]


def test_a_server_whose_adapter_cannot_be_restored_fails_the_run_with_its_address_and_cause(rollout_on_stub):
    def restore(client):
        raise InferenceServerError("adapter demo-v0 is missing on disk")

    recovery = RecordingRecovery(30, restore=restore)

    @generation
    def route(body):
        return None  # every generation request is dropped: only the recovery's failure can end the run

    rollout = rollout_on_stub(route, recovery=recovery)
    with pytest.raises(InferenceServerError) as err:
        rollout.run(timeout_s=DEADLINE_S)
    message = str(err.value)
    assert rollout.server.url in message and "could not be re-registered" in message
    assert "adapter demo-v0 is missing on disk" in message
    assert rollout.producer.error is err.value
    assert not recovery.is_up(rollout.client)


def test_with_every_server_down_nothing_is_sent_until_one_is_back(rollout_on_stub):
    restoring, back = threading.Event(), threading.Event()

    def restore(client):  # the server answers its health check again; its adapter is being put back
        restoring.set()
        assert back.wait(DEADLINE_S)

    recovery = ServerRecovery(30, restore=restore)
    rollout = rollout_on_stub(recovery=recovery, park=True)
    cond = rollout.producer.admission.cond
    outage = threading.Thread(target=recovery.recover, args=(rollout.client, 0), daemon=True)
    outage.start()
    assert restoring.wait(DEADLINE_S) and not recovery.is_up(rollout.client)
    rollout.producer.start()
    with cond:
        cond.parked.clear()
        rollout.producer.set_policy(0, "demo-v0")  # a version is served: only the server being down holds it back
    assert cond.parked.wait(DEADLINE_S), "the producer never parked"
    with cond:
        assert (rollout.producer.inflight, rollout.generation_bodies()) == (0, [])
    back.set()  # the recovery finishes and wakes the producer
    groups = rollout.queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)
    assert sorted(g.index for g in groups) == [0, 1]
    assert len(rollout.generation_bodies()) == 2


class UnreadableRows(list):
    """Rows whose reading fails (as a lazily read dataset's can): a failure of the producer thread itself."""

    def __getitem__(self, i):
        raise OSError(f"row {i} could not be read")


def test_a_failure_of_the_producer_thread_itself_reaches_the_trainer_and_nothing_is_sent(rollout_on_stub):
    rows = UnreadableRows(PromptRow(prompt="p", prompt_ids=[1], columns={}) for _ in range(4))
    rollout = rollout_on_stub(rows=rows)
    with pytest.raises(OSError, match="could not be read") as err:
        rollout.run(timeout_s=DEADLINE_S)
    assert rollout.producer.error is err.value
    assert rollout.generation_bodies() == []  # the row is read before a request is sent


def test_requests_go_round_robin_over_the_servers(rollout_on_stub):
    rollout = rollout_on_stub(servers=2, groups_per_step=4, per_device_train_batch_size=8)
    groups = rollout.run()
    assert sorted(g.index for g in groups) == [0, 1, 2, 3]
    assert [len(rollout.generation_bodies(s)) for s in rollout.servers] == [2, 2]


def test_a_server_being_recovered_gets_no_request_while_another_is_up(rollout_on_stub):
    restoring, back = threading.Event(), threading.Event()

    def restore(client):
        restoring.set()
        assert back.wait(DEADLINE_S)

    recovery = ServerRecovery(30, restore=restore)
    rollout = rollout_on_stub(recovery=recovery, servers=2, groups_per_step=4, per_device_train_batch_size=8)
    down = rollout.clients[1]
    threading.Thread(target=recovery.recover, args=(down, 0), daemon=True).start()
    assert restoring.wait(DEADLINE_S) and not recovery.is_up(down)
    try:
        groups = rollout.run()
    finally:
        back.set()
    assert sorted(g.index for g in groups) == [0, 1, 2, 3]
    assert [len(rollout.generation_bodies(s)) for s in rollout.servers] == [4, 0]


def not_loaded(body: dict) -> tuple[int, str, str]:
    """vLLM's answer to a request for an adapter it does not have (a restarted server knows none)."""
    return 404, "application/json", json.dumps({"error": {"message": f"The model `{body['model']}` does not exist.",
                                                          "type": "NotFoundError", "param": "model", "code": 404}})


def test_a_server_that_forgot_its_adapter_between_requests_is_recovered_and_the_group_sent_again(rollout_on_stub):
    restored = []
    recovery = RecordingRecovery(30, restore=restored.append)

    @generation
    def route(body):
        if not restored:  # restarted unseen: nothing was registered on it since
            return not_loaded(body)
        return rollout_on_stub.answer(body, [[7]] * body["n"])

    rollout = rollout_on_stub(route, recovery=recovery)
    groups = rollout.run(timeout_s=DEADLINE_S)
    assert sorted(g.index for g in groups) == [0, 1]
    assert restored == [rollout.client] and recovery.epoch(rollout.client) == 1
    ((client, seen_epoch, cause),) = recovery.handed
    assert client is rollout.client and seen_epoch == 0
    assert isinstance(cause, AdapterNotLoadedError) and "`demo-v0` does not exist" in str(cause)
    assert rollout.producer.lost_groups == 1 and rollout.producer.resent_groups == 1
    first, again = [b["prompt"] for b in rollout.generation_bodies()][:2]
    assert first == again  # the lost prompt, sent again before any new one


def test_a_server_that_forgets_again_right_after_its_recovery_fails_the_run_with_the_likely_cause(rollout_on_stub):
    restored = []
    recovery = RecordingRecovery(30, restore=restored.append)

    @generation
    def route(body):  # registrations go somewhere else: every request says the adapter does not exist
        return not_loaded(body)

    rollout = rollout_on_stub(route, recovery=recovery)
    with pytest.raises(InferenceServerError) as err:
        rollout.run(timeout_s=DEADLINE_S)
    message = str(err.value)
    assert "`demo-v0` does not exist" in message and rollout.server.url in message
    assert "right after it was registered on it again" in message and "list each server in vllm_server_base_url" \
        in message
    assert restored == [rollout.client]  # one recovery, then the second forgetting ends the run
    assert len(rollout.generation_bodies()) == 2 and rollout.producer.error is err.value


def test_an_adapter_missing_on_a_server_being_recovered_is_that_outage_not_a_second_forgetting(rollout_on_stub):
    """The request reached the restarted server before its recovery registered the adapter (its connection retries
    outlasted the restart): the group is lost in that outage. A later forgetting, after the recovery, is a new
    restart (recovered again), not the run's end: only one right after a recovery that itself followed one is."""
    restoring, back, restored = threading.Event(), threading.Event(), []

    def restore(client):
        restored.append(client)
        if len(restored) == 1:
            restoring.set()
            assert back.wait(DEADLINE_S)

    recovery = ServerRecovery(30, restore=restore)
    answers = []

    @generation
    def route(body):
        answers.append(body["prompt"])
        if len(answers) == 1:  # an outage is being recovered while this request meets the restarted server
            threading.Thread(target=recovery.recover, args=(rollout.client, 0), daemon=True).start()
            assert restoring.wait(DEADLINE_S)
            threading.Timer(0.2, back.set).start()
            return not_loaded(body)
        if len(answers) == 2:  # the first request after that recovery: the server restarted again, unseen
            return not_loaded(body)
        return rollout_on_stub.answer(body, [[7]] * body["n"])

    rollout = rollout_on_stub(route, recovery=recovery)
    groups = rollout.run(timeout_s=DEADLINE_S)
    assert sorted(g.index for g in groups) == [0, 1]
    assert restored == [rollout.client] * 2 and recovery.epoch(rollout.client) == 2
    assert rollout.producer.lost_groups == 2 and rollout.producer.error is None


def test_a_server_that_served_between_two_forgettings_is_recovered_both_times(rollout_on_stub):
    restored, answers = [], []
    recovery = ServerRecovery(30, restore=restored.append)

    @generation
    def route(body):  # restarted unseen before the first request and again after the second
        answers.append(body["prompt"])
        if len(answers) in (1, 3):
            return not_loaded(body)
        return rollout_on_stub.answer(body, [[7]] * body["n"])

    rollout = rollout_on_stub(route, recovery=recovery)
    groups = rollout.run(timeout_s=DEADLINE_S)
    assert len(groups) == 2 and rollout.producer.error is None and len(answers) == 4
    assert restored == [rollout.client] * 2 and rollout.producer.lost_groups == 2
