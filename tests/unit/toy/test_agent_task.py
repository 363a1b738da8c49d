"""The toy agent task: the hidden table's chains and split, the stateful `lookup()` environment, and the reward."""

import collections
import re

import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.agent_task import (
    KEYS,
    N_CHAINS,
    ChainEndedError,
    LookupEnv,
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


def _call():
    return {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]}


def test_chains_have_one_to_four_hops_short_ones_more_often():
    table, chains = make_table(0)
    hops = collections.Counter(len(c) - 1 for c in chains)
    assert len(chains) == N_CHAINS and set(hops) == {1, 2, 3, 4}
    assert hops[1] > hops[2] > hops[3] > hops[4] > 0.05 * N_CHAINS  # long-tailed, and the tail is there
    keys = [k for c in chains for k in c[:-1]]
    assert len(keys) == len(set(keys)) == len(table)  # chains never share a key
    assert all(k in KEYS for k in keys) and all(re.fullmatch(r"[0-9]", c[-1]) for c in chains)


def test_lookup_walks_the_chain_from_the_rows_key_and_ends_on_its_answer(env):
    train, heldout = make_agent_split(0)
    table = make_table(0)[0]
    for row in train[:40] + heldout[:40]:
        env.reset(**row)
        results = [env.lookup() for _ in range(row["hops"])]
        keys = [r.removeprefix("-> ") for r in results[:-1]]
        assert all(r.startswith("-> ") for r in results[:-1]) and results[-1] == f"= {row['answer']}"
        assert [table[k] for k in [row["key"], *keys]] == [*keys, row["answer"]]  # one hop per call, in order
        assert row["prompt"] == [{"role": "user", "content": f"find {row['key']}"}]
        assert env.calls == row["hops"]


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


def test_a_call_after_the_value_raises_an_error_that_says_to_answer(env):
    row = next(r for r in make_agent_split(0)[0] if r["hops"] == 1)
    env.reset(**row)
    assert env.lookup() == f"= {row['answer']}"
    with pytest.raises(ChainEndedError, match=f"^the chain ended at {row['answer']}; answer that value$"):
        env.lookup()
    assert env.calls == 2


def test_reset_needs_the_rows_world_and_key_and_starts_the_walk_again(env):
    with pytest.raises(RuntimeError, match="before reset"):
        env.lookup()
    with pytest.raises(ConfigError, match="world_seed"):
        env.reset(prompt="find aa", answer="12", key="aa")
    with pytest.raises(ConfigError, match="`key`: missing"):
        env.reset(prompt="find aa", answer="12", world_seed=0)
    with pytest.raises(ConfigError, match="starts no chain"):
        env.reset(key=next(k for k in KEYS if k not in make_table(0)[0]), world_seed=0)
    row = next(r for r in make_agent_split(0)[0] if r["hops"] >= 2)
    assert env.reset(**row) is None  # nothing is appended to the user message
    first = env.lookup()
    env.reset(**row)
    assert (env.calls, env.lookup()) == (0, first)


def test_latency_knob_is_the_class_attribute_else_the_environment_variable(env, monkeypatch):
    import time

    env.reset(**next(r for r in make_agent_split(0)[0] if r["hops"] == 4))
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    LookupEnv.latency_s = 0.25
    env.lookup()
    LookupEnv.latency_s = None
    monkeypatch.setenv("ASYNCGRPO_TOY_TOOL_LATENCY_S", "0.5")
    env.lookup()
    monkeypatch.setenv("ASYNCGRPO_TOY_TOOL_LATENCY_S", "0")
    env.lookup()
    assert slept == [0.25, 0.5]


def test_reward_is_one_only_for_the_right_final_answer():
    right = [{"role": "user", "content": "x"}, _call(), {"role": "tool", "name": "lookup", "content": "= 7"},
             {"role": "assistant", "content": " 7 "}]
    wrong = [*right[:-1], {"role": "assistant", "content": "3"}]
    ended_on_call = [_call()]  # max_turns reached: no answer
    ended_on_tool = right[:-1]
    answered_and_called = [{"role": "assistant", "content": "7", **_call()}]
    rewards = lookup_reward([right, wrong, ended_on_call, ended_on_tool, answered_and_called, [], "7"],
                            answer=["7"] * 7)
    assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="answer"):
        lookup_reward([right], answer=["7", "7"])
    assert episode_counts(right) == (2, 1)
