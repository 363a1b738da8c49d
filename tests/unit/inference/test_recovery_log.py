"""One outage, many failed requests: two WARNING lines (down, back), the second with the count of failed calls, not
one line per request. tests/fakes.py's `FakeVLLM` (a real outage's request count is timing)."""

import logging
import threading
import time

from fakes import FakeVLLM

from asyncgrpo.errors import SyncError
from asyncgrpo.inference.recovery import ServerRecovery
from asyncgrpo.rollout.publish import AdapterPublisher


def test_an_outage_is_logged_once_down_and_once_back_with_the_number_of_failed_calls(caplog):
    release = threading.Event()
    server = FakeVLLM("http://node:8000", on_health=lambda s: release.wait(30))  # back once the test releases it
    recovery = ServerRecovery(60)
    threads = [threading.Thread(target=recovery.recover, args=(server, 0, OSError("refused"))) for _ in range(5)]
    with caplog.at_level(logging.WARNING, logger="asyncgrpo"):
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while recovery._failed_calls.get(server.base_url, 0) < 5:  # every request has reported its failure
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        for t in threads:
            t.join(30)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("inference server http://node:8000 stopped answering (refused)")
    assert warnings[1].endswith("5 calls failed during the outage (lost rollouts are generated again)")


def test_a_sync_that_failed_on_a_dead_server_does_not_claim_it_still_serves(tmp_path):
    publisher = AdapterPublisher([FakeVLLM("http://dead:8000", back_at=None)], "run")  # down for good
    try:
        publisher.publish(1, tmp_path)
    except SyncError as exc:
        message = str(exc)
    assert "The server did not answer (it is down or restarting); nothing is being served by it now." in message
    assert "still serves" not in message
