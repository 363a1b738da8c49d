"""inflight_weight_updates against the real server: completions, and the turns of an episode, stopped mid-way go on
from their tokens on the new adapter, and every token's recorded logprob is the one of the version it is tagged
with."""

import contextlib
import uuid

from asyncgrpo.rollout.inflight import InflightStats, sample_across_versions
from asyncgrpo.store import AdapterStore

PROMPT = [3 + b for b in b"42,24>"]
MAX_TOKENS = 60
SWITCH_AFTER_CHUNKS = 16  # n=2: each chunk carries one choice, so the switch lands ~8 tokens into each completion


def load_two_versions(client, world, tmp_path, random_adapter, prefix: str, seeds: tuple[int, int]) -> dict[int, str]:
    """Two random adapters of the toy base loaded on the server as versions 1 and 2: {version: adapter name}."""
    store = AdapterStore(tmp_path)
    tag = uuid.uuid4().hex[:6]
    names = {1: f"{prefix}-a-{tag}", 2: f"{prefix}-b-{tag}"}
    for version, seed in zip((1, 2), seeds):
        client.load_adapter(names[version], store.write(version, *random_adapter(seed=seed),
                                                        base_model=str(world.model_dir)))
    return names


def test_a_publish_mid_completion_moves_it_onto_the_new_adapter_and_each_token_keeps_its_versions_logprob(
        world, client, tmp_path, random_adapter):
    names = load_two_versions(client, world, tmp_path, random_adapter, "inflight", seeds=(11, 12))
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


def test_a_publish_mid_turn_moves_an_episodes_turn_onto_the_new_adapter_and_each_token_keeps_its_versions_logprob(
        world, client, tmp_path, random_adapter):
    """A 2-turn episode (tests/agent_format.py: the toy model knows no tool format, so every non-empty turn is a
    `lookup` call and max_turns 2 ends it): version 1 is the base model, which answers the toy's question with digits
    (a random adapter may end the turn at once, and an empty turn calls no tool); version 2, a random adapter, goes
    live after the first turn's first streamed token, so that turn goes on on version 2, and the second turn starts
    there."""
    from agent_format import agent_tokenizer, lookup
    from fakes import cfg as make_cfg

    from asyncgrpo.data import PromptRow
    from asyncgrpo.rollout.episodes import ChatFormat, EpisodeRunner, MidTurn

    tok = agent_tokenizer()
    adapter = f"inflight-turn-{uuid.uuid4().hex[:6]}"
    client.load_adapter(adapter, AdapterStore(tmp_path).write(2, *random_adapter(seed=22),
                                                              base_model=str(world.model_dir)))
    names = {1: client.base_model(), 2: adapter}
    asked = []

    def served() -> int:
        asked.append(1)
        return 1 if len(asked) <= 1 else 2  # version 2 from the second question on: after the first chunk

    @contextlib.contextmanager
    def latest():
        version = served()
        yield version, names[version]

    cfg = make_cfg(num_generations=2, tools=["agent_format:lookup"], max_turns=2, max_completion_length=12,
                   episode_version="latest", inflight_weight_updates=True)
    runner = EpisodeRunner(ChatFormat(tok, tok.response_template, stop_ids={0}), cfg, tools=[lookup], factory=None,
                           max_model_len=256)
    row = PromptRow(prompt=[{"role": "user", "content": "07,45>"}], prompt_ids=[], columns={}, rendered="07,45>")
    stats = InflightStats()
    e = runner.start(row)
    try:
        runner.run(client, e, adapter=names[1], version=1, seed=5, latest=latest,
                   mid_turn=MidTurn(served=served, stats=stats))
        whole = e.prompt_ids + e.ids
        scores = {v: client.score(names[v], whole)[len(e.prompt_ids):] for v in names}
    finally:
        client.unload_adapter(adapter)

    assert e.turns == 2 and stats.continuations >= 1
    first_turn = e.loss_mask.index(0)  # the first turn's sampled ids end where its tool suffix begins
    assert e.versions[0] == 1 and 2 in e.versions[:first_turn], e.versions  # it moved in the middle of turn 1
    sampled = [t for t, m in enumerate(e.loss_mask) if m]
    assert {e.versions[t] for t in sampled[first_turn:]} == {2}  # turn 2 entirely on version 2
    tagged = [scores[e.versions[t]][t] for t in sampled]
    assert max(abs(a - e.logprobs[t]) for a, t in zip(tagged, sampled)) < 1e-3  # each token: its version's logprob
    moved = [t for t in sampled if e.versions[t] == 2]
    assert max(abs(scores[1][t] - e.logprobs[t]) for t in moved) > 1e-2  # and version 1 would have given others
