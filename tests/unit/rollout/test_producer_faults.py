"""The rollout producer when a server dies under a request. A stub HTTP server stands in for vLLM: a real one cannot
be made to drop exactly the first generation request on demand (the integration test kills a real server, but
whether a request is in flight at that moment is timing)."""


import pytest
from fakes import generation


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # each request's thread ends cleanly
@pytest.mark.parametrize("drops", [1, 2])
def test_a_group_lost_with_its_server_is_generated_again_before_new_prompts(rollout_on_stub, drops):
    prompts_sent = []

    @generation
    def route(body):
        prompts_sent.append(body["prompt"])
        if len(prompts_sent) <= drops:
            return None  # the server dies under the first request(s): no answer at all
        return rollout_on_stub.answer(body, [[7]] * body["n"])

    rollout = rollout_on_stub(route)
    groups = rollout.run()
    rollout_on_stub.stop(rollout.producer)
    assert (rollout.producer.lost_groups, rollout.producer.resent_groups) == (drops, drops)
    assert all(p == prompts_sent[0] for p in prompts_sent[:drops + 1])  # the lost prompt went out again, before the next one
    assert sorted(g.index for g in groups) == [0, 1]  # so the batch holds the first two prompts: none skipped
    assert all(g.rewards == [1.0, 1.0] for g in groups)
