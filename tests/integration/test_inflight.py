"""inflight_weight_updates against the real server: completions stopped mid-way go on from their tokens on the new
adapter, and every token's recorded logprob is the one of the version it is tagged with."""

import contextlib
import uuid

from asyncgrpo.rollout.inflight import InflightStats, sample_across_versions
from asyncgrpo.store import AdapterStore

PROMPT = [3 + b for b in b"42,24>"]
MAX_TOKENS = 60
SWITCH_AFTER_CHUNKS = 16  # n=2: each chunk carries one choice, so the switch lands ~8 tokens into each completion


def test_a_publish_mid_completion_moves_it_onto_the_new_adapter_and_each_token_keeps_its_versions_logprob(
        world, client, tmp_path, random_adapter):
    store = AdapterStore(tmp_path)
    tag = uuid.uuid4().hex[:6]
    names = {1: f"inflight-a-{tag}", 2: f"inflight-b-{tag}"}
    for version, seed in ((1, 11), (2, 12)):
        client.load_adapter(names[version], store.write(version, *random_adapter(seed=seed),
                                                        base_model=str(world.model_dir)))
    asked = []

    def served() -> int:  # version 2 goes live after the first request has streamed SWITCH_AFTER_CHUNKS chunks
        asked.append(1)
        return 1 if len(asked) <= SWITCH_AFTER_CHUNKS else 2

    @contextlib.contextmanager
    def policy():
        yield 2, names[2]

    stats = InflightStats()
    try:
        out = sample_across_versions(client, PROMPT, n=2, max_tokens=MAX_TOKENS, first=(1, names[1]), policy=policy,
                                     served=served, stats=stats, extra={"ignore_eos": True})
        scores = {v: [client.score(names[v], PROMPT + s.token_ids)[len(PROMPT):] for s in out] for v in names}
    finally:
        for name in names.values():
            client.unload_adapter(name)

    assert (stats.continuations, stats.completions_moved) == (1, 2)
    for i, s in enumerate(out):
        assert len(s.token_ids) == len(s.logprobs) == len(s.versions) == MAX_TOKENS and s.finish_reason == "length"
        assert 1 in s.versions and 2 in s.versions, s.versions  # the switch landed mid-completion
        switch = s.versions.index(2)
        assert s.versions == [1] * switch + [2] * (MAX_TOKENS - switch)
        tagged = [scores[v][i][t] for t, v in enumerate(s.versions)]
        assert max(abs(a - b) for a, b in zip(tagged, s.logprobs)) < 1e-3  # each token: its own version's logprob
        # The adapters are told apart: the tokens sampled on B are not what A would have given them.
        assert max(abs(a - b) for a, b in zip(scores[1][i][switch:], s.logprobs[switch:])) > 1e-2
