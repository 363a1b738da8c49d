"""The rollout producer after a failure: nothing more is sent, and `stop()` does not wait for the requests still in
flight. A stub HTTP server stands in for vLLM: a real one cannot be made to fail one request while it holds the
others on demand."""

import threading
import time

import pytest
from fakes import generation

from asyncgrpo.errors import InferenceServerError

INFLIGHT = 3
DEADLINE_S = 15.0


def test_after_a_failed_request_nothing_more_is_sent_and_stop_does_not_wait_for_the_rest(rollout_on_stub):
    all_sent = threading.Event()  # INFLIGHT requests have reached the server
    release = threading.Event()  # the held requests may answer (only at the end of the test)
    prompts, timed_out = [], []
    lock = threading.Lock()

    @generation
    def route(body):
        prompt = body["prompt"]
        with lock:
            prompts.append(prompt)
            first = len(prompts) == 1
            if len(prompts) == INFLIGHT:
                all_sent.set()
        if first:  # the first request to arrive fails, once all of them are in flight
            all_sent.wait(30)
            return 500, "application/json", '{"error": "engine dead"}'
        if not release.wait(60):  # the others hang, as on a server that stopped generating
            timed_out.append(prompt)
        return 500, "application/json", '{"error": "late"}'

    # max_staleness 1: two batches (4 groups) may be in flight, but only INFLIGHT requests at once
    rollout = rollout_on_stub(route, max_staleness=1, max_inflight_requests=INFLIGHT, client_timeout_s=120)
    producer, queue = rollout.producer, rollout.queue
    producer.start()
    try:
        producer.set_policy(0, "demo-v0")
        with pytest.raises(InferenceServerError, match="engine dead"):
            queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)
        rollout_on_stub.stop(producer)
        # stop() returned while the other requests still hang on the server: it did not wait for them.
        assert not release.is_set() and timed_out == []
        assert producer.inflight == INFLIGHT - 1
        # Nothing was sent after the failure: only the requests already in flight ever reached the server.
        assert len(prompts) == INFLIGHT
        assert producer.error is not None and "engine dead" in str(producer.error)
    finally:
        release.set()
        rollout_on_stub.stop(producer)


def test_an_answer_arriving_after_a_failure_is_dropped_unscored(rollout_on_stub):
    # Two requests in flight; the first fails, and only then does the second answer (well-formed): the producer has
    # failed, so that answer is neither counted nor scored nor queued, although nobody called stop() yet.
    both_sent, release = threading.Event(), threading.Event()
    bodies, scored = [], []
    lock = threading.Lock()

    @generation
    def route(body):
        with lock:
            bodies.append(body)
            first = len(bodies) == 1
            if len(bodies) == 2:
                both_sent.set()
        if first:
            both_sent.wait(30)
            return 500, "application/json", '{"error": "engine dead"}'
        assert release.wait(30), "the late answer was never released"
        return rollout_on_stub.answer(body, [[7]] * body["n"])

    def reward(prompts, completions, **columns):
        scored.append(completions)
        return [1.0] * len(completions)

    rollout = rollout_on_stub(route, reward=reward, max_inflight_requests=2)
    producer = rollout.producer
    producer.start()
    try:
        producer.set_policy(0, "demo-v0")
        with pytest.raises(InferenceServerError, match="engine dead"):
            rollout.queue.take(2, trainer_version=0, timeout_s=DEADLINE_S)
        release.set()
        deadline = time.monotonic() + DEADLINE_S
        while producer.inflight:  # the late answer's request ends (finished, whatever became of its answer)
            assert time.monotonic() < deadline, "the late answer's request never ended"
            time.sleep(0.005)
        assert (producer.generated_tokens, scored, len(rollout.queue)) == (0, [], 0)
        assert len(bodies) == 2 and "engine dead" in str(producer.error)
    finally:
        release.set()
        rollout_on_stub.stop(producer)


def test_stop_on_a_producer_never_started_returns_and_sends_nothing(rollout_on_stub):
    # The trainer's cleanup stops the producer after a setup that failed before `start()` (e.g. unloading a previous
    # run's adapters): joining a thread that never started would raise and hide the setup's own error.
    rollout = rollout_on_stub()
    rollout.producer.set_policy(0, "demo-v0")
    rollout_on_stub.stop(rollout.producer)
    assert rollout.producer.error is None and rollout.generation_bodies() == []


def test_after_a_failed_request_the_producer_thread_ends_without_sending_the_next_prompt(rollout_on_stub):
    @generation
    def route(body):
        return 500, "application/json", '{"error": "engine dead"}'  # an answer, unlike a dead server: not resent

    rollout = rollout_on_stub(route)  # one request in flight at a time: the next prompt waits for this one
    with pytest.raises(InferenceServerError, match="engine dead"):
        rollout.run(timeout_s=15)
    deadline = time.monotonic() + 15
    while any(t.name == "rollout-producer" for t in threading.enumerate()):  # public: the thread's name
        assert time.monotonic() < deadline, "the producer thread kept running after the failure"
        time.sleep(0.005)
    assert len(rollout.generation_bodies()) == 1 and rollout.producer.lost_groups == 0


def test_stop_waits_for_an_answer_being_scored_and_returns_once_it_is_scored(rollout_on_stub):
    # Scoring runs reward functions (torch) in the request's daemon thread: it must not still run when the trainer
    # exits after stop(). A request still waiting for its answer is not waited for (the tests above).
    scoring, release = threading.Event(), threading.Event()

    def reward(prompts, completions, **columns):
        scoring.set()
        assert release.wait(DEADLINE_S)
        return [1.0] * len(completions)

    rollout = rollout_on_stub(reward=reward)
    rollout.producer.start()
    rollout.producer.set_policy(0, "demo-v0")
    assert scoring.wait(DEADLINE_S)
    stopper = threading.Thread(target=rollout.producer.stop, name="test-stop", daemon=True)
    stopper.start()
    stopper.join(1.0)  # a stop() that does not wait returns well within this; one that waits is still alive
    assert stopper.is_alive(), "stop() returned while an answer was still being scored"
    release.set()
    stopper.join(DEADLINE_S)  # a liveness bound: the count of answers being scored must get back to 0
    assert not stopper.is_alive(), "stop() kept waiting after the answer was scored"
    assert len(rollout.queue) == 0 and rollout.producer.error is None  # scored after stop(): dropped, not queued
