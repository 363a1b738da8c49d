"""The doctor checks added for operator faults: a paused server, and the server's logprob mode. `FakeVLLM`
(tests/fakes.py) answers what a real server would (tests/integration/test_paused_server.py and test_faults.py use
real servers)."""

from types import SimpleNamespace

from fakes import FakeVLLM

from asyncgrpo.inference.checks import ServerContext, check_logprobs_mode, check_not_paused

NODE = "http://node:8000"


def ctx(client, **cfg):
    values = dict(temperature=1.0, top_p=1.0)
    values.update(cfg)
    return ServerContext(SimpleNamespace(**values), client, "/models/m")


def test_a_paused_server_fails_with_curl_post_resume_as_the_fix():
    line = check_not_paused(ctx(FakeVLLM(NODE, paused=True))).line()
    assert line == ("FAIL  not paused: http://node:8000 is paused (GET /is_paused answers true), most likely by a run "
                    "killed during a weight sync; it holds every request. Fix: `curl -X POST http://node:8000/resume` "
                    "(POST /resume); `asyncgrpo train` resumes it at start")
    assert check_not_paused(ctx(FakeVLLM(NODE, paused=False))).ok is True
    assert check_not_paused(ctx(FakeVLLM(NODE, dev_mode=False))).ok is True  # no pause route: cannot be paused


def test_raw_logprobs_fail_only_when_the_config_sampling_differs_from_the_raw_distribution():
    raw = FakeVLLM(NODE, logprobs_mode="raw_logprobs")
    failed = check_logprobs_mode(ctx(raw, temperature=0.7))
    assert failed.ok is False
    assert "the server returns raw_logprobs (from /server_info), the logprobs of the model before temperature 0.7" \
        in failed.line()
    assert failed.fix.startswith("restart it with --logprobs-mode processed_logprobs")
    assert "top_p 0.9" in check_logprobs_mode(ctx(raw, top_p=0.9)).detail
    assert check_logprobs_mode(ctx(raw)).ok is True  # temperature 1, no truncation: raw == processed
    assert check_logprobs_mode(ctx(FakeVLLM(NODE), temperature=0.7)).ok is True


def test_without_server_info_the_mode_is_probed_at_two_temperatures():
    probed_raw = check_logprobs_mode(ctx(FakeVLLM(NODE, logprobs_mode="raw_logprobs", dev_mode=False),
                                         temperature=0.7))
    assert probed_raw.ok is False and "raw_logprobs (probed: top logprobs moved by 0 between" in probed_raw.detail
    probed = check_logprobs_mode(ctx(FakeVLLM(NODE, dev_mode=False), temperature=0.7))
    assert probed.ok is True and probed.detail.startswith("processed_logprobs (probed: top logprobs moved by 3 ")
