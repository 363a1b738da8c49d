"""sample_across_versions: completions stopped when a newer version is served go on from their tokens on it.

The client here is a scripted stand-in for `InferenceClient.complete_until` (what a real server does to a closed
stream is the integration test's: tests/integration/test_inflight.py)."""

import contextlib

from asyncgrpo.inference.client import Completion
from asyncgrpo.rollout.inflight import InflightStats, sample_across_versions

PROMPT = [5, 6, 7]


class ScriptedClient:
    """Answers each complete_until call with the next scripted list of (token ids, finish reason), logprob of a token
    = -(its id) / 100; records each call's adapter, prompts and budget."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = []

    def complete_until(self, model, prompts, *, n, max_tokens, interrupted, temperature=1.0, top_p=1.0, seed=None,
                       extra=None):
        self.calls.append({"model": model, "prompts": prompts, "n": n, "max_tokens": max_tokens, "seed": seed})
        interrupted()  # asked after a chunk, as the real client asks it
        out = self.answers.pop(0)
        assert len(out) == len(prompts) * n
        return [Completion(list(ids), [-t / 100 for t in ids], "", reason, model) for ids, reason in out]


def policy_of(served):
    @contextlib.contextmanager
    def now():
        yield served[0], f"a-{served[0]}"
    return now


def test_an_interrupted_completion_goes_on_from_its_tokens_on_the_new_version_each_token_tagged():
    served = [2]  # version 2 went live while the first request ran on version 1
    client = ScriptedClient([
        [([10, 11], ""), ([20, 21, 22, 2], "stop")],  # completion 0 cut after two tokens; 1 finished on version 1
        [([12, 2], "stop")],                          # completion 0 continued on version 2
    ])
    stats = InflightStats()
    out = sample_across_versions(client, PROMPT, n=2, max_tokens=6, first=(1, "a-1"), policy=policy_of(served),
                                 served=lambda: served[0], stats=stats, seed=9)
    assert [s.token_ids for s in out] == [[10, 11, 12, 2], [20, 21, 22, 2]]
    assert [s.versions for s in out] == [[1, 1, 2, 2], [1, 1, 1, 1]]
    assert out[0].logprobs == [-0.10, -0.11, -0.12, -0.02] and [s.finish_reason for s in out] == ["stop", "stop"]
    second = client.calls[1]
    assert second == {"model": "a-2", "prompts": [PROMPT + [10, 11]], "n": 1, "max_tokens": 4, "seed": None}
    assert client.calls[0]["seed"] == 9 and client.calls[0]["n"] == 2
    assert (stats.continuations, stats.completions_moved, stats.tokens_cut) == (1, 1, 0)


def test_a_continuation_of_several_completions_cuts_each_at_its_own_budget():
    served = [3]
    client = ScriptedClient([
        [([1], ""), ([1, 1, 1], "abort")],  # a pause in abort mode ends a completion "abort": it goes on as well
        [([4, 4, 4, 4], "length"), ([5, 5, 5, 5], "length")],  # both asked for 5 - 1 = 4 more tokens
    ])
    stats = InflightStats()
    out = sample_across_versions(client, PROMPT, n=2, max_tokens=5, first=(2, "a-2"), policy=policy_of(served),
                                 served=lambda: served[0], stats=stats)
    assert client.calls[1]["max_tokens"] == 4 and client.calls[1]["prompts"] == [PROMPT + [1], PROMPT + [1, 1, 1]]
    assert [s.token_ids for s in out] == [[1, 4, 4, 4, 4], [1, 1, 1, 5, 5]]
    assert [s.versions for s in out] == [[2, 3, 3, 3, 3], [2, 2, 2, 3, 3]]
    assert [s.finish_reason for s in out] == ["length", "length"]
    assert stats.tokens_cut == 2 and stats.completions_moved == 2


def test_a_completion_cut_exactly_at_its_budget_is_not_continued():
    served = [1]
    client = ScriptedClient([[([7, 7, 7], "")]])  # interrupted after its last allowed token
    out = sample_across_versions(client, PROMPT, n=1, max_tokens=3, first=(0, "a-0"), policy=policy_of(served),
                                 served=lambda: served[0], stats=InflightStats())
    assert len(client.calls) == 1 and out[0].finish_reason == "length" and out[0].versions == [0, 0, 0]


def test_the_stream_is_interrupted_exactly_when_the_served_version_moves():
    served = [4]
    seen = []

    class Recording(ScriptedClient):
        def complete_until(self, model, prompts, *, interrupted, **kw):
            seen.append(interrupted())
            return super().complete_until(model, prompts, interrupted=interrupted, **kw)

    client = Recording([[([1], "stop")]])
    sample_across_versions(client, PROMPT, n=1, max_tokens=3, first=(4, "a-4"), policy=policy_of(served),
                           served=lambda: served[0], stats=InflightStats())
    served[0] = 5
    client.answers = [[([1], "")], [([2], "stop")]]
    sample_across_versions(client, PROMPT, n=1, max_tokens=3, first=(4, "a-4"), policy=policy_of(served),
                           served=lambda: served[0], stats=InflightStats())
    assert seen == [False, True, False]  # same version: go on; moved: stop; the continuation runs on the new one
