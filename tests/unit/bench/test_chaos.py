"""`bench chaos`'s pure parts: the seeded fault plan, the memory figures, the verdicts, and the malformed requests
against a loopback server of this test's own (a plain socket server: what a probe reports for each way a port
can answer)."""

import socket
import threading

import pytest

from asyncgrpo.bench.chaos import KINDS, Chaos, by_kind, goal, plan
from asyncgrpo.bench.chaos_cast import malformed_requests, send_raw


def test_the_plan_is_the_seeds_covers_every_kind_and_keeps_off_the_first_checkpoint_and_the_last_steps():
    a = plan(500, 10, KINDS, seed=3, first_step=26)
    assert a == plan(500, 10, KINDS, seed=3, first_step=26)  # the seed decides everything
    assert a != plan(500, 10, KINDS, seed=4, first_step=26)
    assert {f["kind"] for f in a} == set(KINDS) and len(a) == 10
    steps = [f["step"] for f in a]
    assert steps == sorted(steps) and len(set(steps)) == 10 and min(steps) >= 26 and max(steps) <= 498
    assert all(0 <= f["delay_s"] <= 1 for f in a)


def test_a_short_run_gets_at_most_one_fault_per_step():
    faults = plan(12, 30, ("rank", "receiver"), seed=0, first_step=5)
    assert [f["step"] for f in faults] == list(range(5, 11))


def _chaos_with(samples):
    chaos = Chaos.__new__(Chaos)
    chaos.samples = samples
    return chaos


def test_memory_growth_is_measured_per_process_after_its_warm_up_and_over_the_longest_life():
    mib = 2**20
    samples = [  # rank 0 restarted at 50 trained steps; the second life lasts long enough, the first does not
        {"trained": 25, "step": 25, "role": "trainer_rank0", "pids": [10], "rss": 100 * mib},
        {"trained": 50, "step": 50, "role": "trainer_rank0", "pids": [10], "rss": 150 * mib},
        {"trained": 75, "step": 40, "role": "trainer_rank0", "pids": [11], "rss": 300 * mib},
        {"trained": 100, "step": 65, "role": "trainer_rank0", "pids": [11], "rss": 200 * mib},
        {"trained": 150, "step": 115, "role": "trainer_rank0", "pids": [11], "rss": 201 * mib},
        {"trained": 300, "step": 265, "role": "trainer_rank0", "pids": [11], "rss": 204 * mib},
    ]
    mem = _chaos_with(samples).memory()["trainer_rank0"]
    assert mem["mib_at_step_100"] == 201.0 and mem["mib_at_end"] == 204.0 and mem["processes"] == 2
    # from its first sample after warm-up (trained 100) to its last (300): 4 MiB of 200 over 200 steps = 1% / 100
    assert mem["growth"] == {"steps": 200, "from_mib": 200.0, "to_mib": 204.0, "pct_per_100_steps": 1.0}


def test_a_process_that_never_lived_long_enough_has_no_growth_figure():
    samples = [{"trained": t, "step": t, "role": "receiver", "pids": [t // 50], "rss": 2**20} for t in (25, 50, 75)]
    assert _chaos_with(samples).memory()["receiver"]["growth"] is None


def _result(**kw):
    base = {"faults": [], "segments": [{"exit_code": 0}], "memory": {"r": {"growth": {"pct_per_100_steps": 0.5}}},
            "finished": True, "final_run_lost_groups": 3, "final_run_resent_groups": 3, "left_running": {}}
    return base | kw


def test_the_goal_needs_survivable_faults_survived_and_the_others_ended_with_a_clear_error():
    assert goal(_result())["met"] is True
    ended = [{"kind": "rank", "outcome": "ended_run"}]
    assert goal(_result(faults=ended, segments=[{"exit_code": 1, "errors": ["exitcode : -9"]},
                                                {"exit_code": 0}]))["met"] is True
    assert goal(_result(faults=ended, segments=[{"exit_code": 1, "errors": []}, {"exit_code": 0}]))["met"] is False
    assert goal(_result(faults=[{"kind": "receiver", "outcome": "ended_run"}]))["every_fault_handled"] is False
    assert goal(_result(faults=[{"kind": "rank", "outcome": "ended_run_no_checkpoint"}]))["met"] is False


@pytest.mark.parametrize("change, failed", [
    ({"final_run_lost_groups": 4}, "nothing_lost"), ({"finished": False}, "nothing_lost"),
    ({"memory": {"r": {"growth": {"pct_per_100_steps": 2.5}}}}, "memory_growth_below_2pct_per_100_steps"),
    ({"memory": {"r": {"growth": None}}}, "memory_growth_below_2pct_per_100_steps"),
    ({"left_running": {123: "vllm"}}, "nothing_left_running")])
def test_each_part_of_the_goal_can_fail_it(change, failed):
    verdict = goal(_result(**change))
    assert verdict[failed] is False and verdict["met"] is False


def test_by_kind_counts_each_outcome():
    records = [{"kind": "server", "outcome": "survived"}, {"kind": "server", "outcome": "ended_run"},
               {"kind": "rank", "outcome": "ended_run"}, {"kind": "rollout", "outcome": "pending"}]
    assert by_kind(records) == {
        "server": {"injected": 2, "survived": 1, "ended_run_resumed": 1, "not_handled": 0},
        "rank": {"injected": 1, "survived": 0, "ended_run_resumed": 1, "not_handled": 0},
        "rollout": {"injected": 1, "survived": 0, "ended_run_resumed": 0, "not_handled": 1}}


def test_a_probe_reports_an_answer_a_silent_port_and_a_closed_one():
    import random

    payloads = malformed_requests(random.Random(0))
    assert set(payloads) == {"garbage_bytes", "bad_json", "oversized_header", "wrong_keys"}
    assert len(payloads["oversized_header"]) > 100_000 and payloads["bad_json"].startswith(b"POST ")
    with socket.create_server(("127.0.0.1", 0)) as answering, socket.create_server(("127.0.0.1", 0)) as silent:
        def answer():
            conn, _ = answering.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer)
        thread.start()
        assert send_raw(answering.getsockname()[1], payloads["bad_json"]) == "HTTP/1.1 400 Bad Request"
        thread.join()
        # accepted by the kernel, never by the program: no answer
        assert send_raw(silent.getsockname()[1], b"xx", timeout_s=0.5) == "no answer within 0.5 s"
        port = silent.getsockname()[1]
    assert send_raw(port, b"xx") == "connection failed (ConnectionRefusedError)"


def test_the_rollout_side_is_a_child_process_or_rollout_serve_reached_by_its_address(tmp_path):
    from asyncgrpo.bench.chaos import _run_args

    class At:
        url = "http://127.0.0.1:1"

    child = _run_args(tmp_path, "run", At, At, 10, 0, 2, [])
    served = _run_args(tmp_path, "run", At, At, 10, 0, 2, [], rollout_address="127.0.0.1:7480")
    assert child[child.index("--rollout_process") + 1] == "true" and "--rollout_address" not in child
    assert served[served.index("--rollout_address") + 1] == "127.0.0.1:7480" and "--rollout_process" not in served


def test_the_fault_on_the_rollout_side_targets_rollout_serve_when_it_serves_the_run(tmp_path):
    class Serve:
        def pid(self):
            return 4242

    class Child:
        log_path = tmp_path / "train-0.log"

        def rollout_pid(self):
            return 17

    chaos = Chaos.__new__(Chaos)
    chaos.rollout_serve = None
    assert chaos._rollout_pid(Child()) == 17
    chaos.rollout_serve = Serve()
    assert chaos._rollout_pid(Child()) == 4242


def test_an_unknown_rollout_side_is_refused_before_anything_starts(tmp_path):
    from asyncgrpo.bench.chaos import run

    with pytest.raises(ValueError, match="unknown rollout side 'remote'; choose from child, serve"):
        run([], steps=4, rollout_side="remote", workdir=str(tmp_path))
    assert not any(tmp_path.iterdir())


def test_the_servers_processes_are_sampled_one_by_one_beside_their_sum(tmp_path, monkeypatch):
    import os

    import psutil

    from asyncgrpo.bench import chaos as module

    me = psutil.Process(os.getpid())
    chaos = Chaos.__new__(Chaos)
    chaos.samples, chaos.seen, chaos.trained, chaos.rollout_serve = [], {}, 20, None
    chaos.server = type("S", (), {"vllm": type("V", (), {"process": me})})()
    chaos.receiver = type("R", (), {"group": type("G", (), {"pid": None})})()
    segment = type("Seg", (), {"ranks": lambda self: {}, "rollout_pid": lambda self: None,
                               "group": type("G", (), {"pid": None})()})()
    monkeypatch.setattr(module, "tree", lambda pid: [me] if pid is me.pid else [])
    chaos._sample(segment, step=20)
    roles = {s["role"]: s for s in chaos.samples}
    assert set(roles) == {"vllm_server", f"vllm_server/{me.name()}"}
    assert roles["vllm_server"]["rss"] == roles[f"vllm_server/{me.name()}"]["rss"] > 0


def test_a_fault_after_one_that_ended_the_run_waits_for_the_resumed_run(monkeypatch):
    """A killed rank's launch takes a while to go down and may finish a step meanwhile (CI saw it reach the next
    fault's step): that fault must land on the resumed run, not on the one already lost."""
    from asyncgrpo.bench import chaos as module

    monkeypatch.setattr(module, "POLL_S", 0)

    class Proc:
        def __init__(self, codes):
            self.codes = iter(codes)

        def poll(self):
            return next(self.codes)

    class Seg:
        def __init__(self, index, steps, codes):
            self.index, self.steps = index, iter(steps)
            self.group = type("G", (), {"process": Proc(codes)})()

    # The first run reaches step 10 (the malformed fault's) after its rank was killed at 8, then exits 1; the
    # resumed one starts at its checkpoint (8) and finishes.
    segments = [Seg(0, [7, 8, 9, 10, 10, 10], [None] * 5 + [1]), Seg(1, [8, 9, 10, 11, 12, 12], [None] * 5 + [0])]
    chaos = Chaos.__new__(Chaos)
    chaos.steps, chaos.records, chaos.trained = 12, [], 0
    chaos.pending = [{"kind": "rank", "step": 8}, {"kind": "malformed", "step": 10}]
    started = iter(segments)
    chaos._start = lambda resume: next(started)
    chaos.launch = type("L", (), {"step": staticmethod(lambda segment: next(segment.steps)), "segments": segments})()
    chaos._sample = lambda segment, step: None
    chaos.latest_checkpoint = lambda: 8
    chaos._ended = lambda segment, code, step: {"steps": 12} if code == 0 else None

    def inject(fault, segment, step):
        chaos.records.append({**fault, "segment": segment.index, "step_after": step, "outcome": "pending",
                              **({"rank": 1} if fault["kind"] == "rank" else {})})

    chaos._inject = inject
    assert chaos.drive() == {"steps": 12}
    assert [(r["kind"], r["segment"]) for r in chaos.records] == [("rank", 0), ("malformed", 1)]
