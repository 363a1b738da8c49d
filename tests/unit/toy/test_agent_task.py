"""The toy agent task: the hidden table's chains and split, the `lookup` environment, and the episode reward."""

import collections

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.agent_task import (
    KEYS,
    N_CHAINS,
    LookupEnv,
    UnknownKeyError,
    episode_counts,
    lookup_reward,
    make_agent_split,
    make_table,
)


@pytest.fixture
def env():
    LookupEnv.latency_s = 0.0  # the default few milliseconds per call would only slow the tests down
    yield LookupEnv()
    LookupEnv.latency_s = None


def _call(key):
    return {"role": "assistant", "tool_calls": [{"type": "function",
                                                 "function": {"name": "lookup", "arguments": {"key": key}}}]}


def test_chains_have_one_to_four_hops_short_ones_more_often():
    table, chains = make_table(0)
    hops = collections.Counter(len(c) - 1 for c in chains)
    assert len(chains) == N_CHAINS and set(hops) == {1, 2, 3, 4}
    assert hops[1] > hops[2] > hops[3] > hops[4] > 0.05 * N_CHAINS  # long-tailed, and the tail is there
    keys = [k for c in chains for k in c[:-1]]
    assert len(keys) == len(set(keys)) == len(table)  # chains never share a key
    assert all(k in KEYS for k in keys) and all(c[-1].isdigit() and len(c[-1]) == 2 for c in chains)


def test_following_lookups_from_a_question_reaches_its_answer_in_hops_calls(env):
    train, heldout = make_agent_split(0)
    for row in train[:40] + heldout[:40]:
        env.reset(**row)
        entry, calls = row["key"], 0
        while not entry.isdigit():
            entry, calls = env.lookup(entry), calls + 1
        assert (entry, calls) == (row["answer"], row["hops"])
        assert row["prompt"] == [{"role": "user", "content": f"find {row['key']}"}]


def test_split_holds_out_whole_chains_and_is_deterministic_by_seed():
    train, heldout = make_agent_split(0, n_heldout=100)
    assert (len(train), len(heldout)) == (N_CHAINS - 100, 100)
    table, chains = make_table(0)
    heldout_keys = {k for c in chains[:100] for k in c[:-1]}
    train_keys = {k for c in chains[100:] for k in c[:-1]}
    assert heldout_keys.isdisjoint(train_keys) and {r["key"] for r in heldout} <= heldout_keys
    assert make_agent_split(3) == make_agent_split(3)
    assert make_table(3)[0] != make_table(4)[0]
    with pytest.raises(ConfigError, match="n_heldout"):
        make_agent_split(0, n_heldout=N_CHAINS)


def test_unknown_key_raises_an_error_that_names_it(env):
    env.reset(**make_agent_split(0)[0][0])
    unknown = next(k for k in KEYS if k not in make_table(0)[0])
    with pytest.raises(UnknownKeyError, match=f"^unknown key {unknown}$"):
        env.lookup(unknown)
    assert env.calls == [unknown]


def test_reset_needs_the_world_seed_and_starts_a_fresh_episode(env):
    with pytest.raises(RuntimeError, match="before reset"):
        env.lookup("aa")
    with pytest.raises(ConfigError, match="world_seed"):
        env.reset(prompt="find aa", answer="12")
    row = make_agent_split(0)[0][0]
    assert env.reset(**row) is None  # nothing is appended to the user message
    env.lookup(row["key"])
    env.reset(**row)
    assert env.calls == []


def test_latency_knob_is_the_class_attribute_else_the_environment_variable(env, monkeypatch):
    import time

    env.reset(**make_agent_split(0)[0][0])
    key = next(iter(env.table))
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    LookupEnv.latency_s = 0.25
    env.lookup(key)
    LookupEnv.latency_s = None
    monkeypatch.setenv("ASYNCGRPO_TOY_TOOL_LATENCY_S", "0.5")
    env.lookup(key)
    monkeypatch.setenv("ASYNCGRPO_TOY_TOOL_LATENCY_S", "0")
    env.lookup(key)
    assert slept == [0.25, 0.5]


def test_reward_is_one_only_for_the_right_final_answer():
    right = [{"role": "user", "content": "x"}, _call("qx"), {"role": "tool", "name": "lookup", "content": "42"},
             {"role": "assistant", "content": " 42 "}]
    wrong = [*right[:-1], {"role": "assistant", "content": "24"}]
    ended_on_call = [_call("qx")]  # max_turns reached: no answer
    ended_on_tool = right[:-1]
    answered_and_called = [{"role": "assistant", "content": "42", **_call("qx")}]
    rewards = lookup_reward([right, wrong, ended_on_call, ended_on_tool, answered_and_called, [], "42"],
                            answer=["42"] * 7)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="answer"):
        lookup_reward([right], answer=["42", "42"])
    assert episode_counts(right) == (2, 1)
