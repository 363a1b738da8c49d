"""The toy agent world's build (minutes of warm-up on 2 busy cores): its base calls the tool but often wrongly, and
what it saved plays the same episodes after a reload. Integration tier for its duration, not for a server."""

import dataclasses
import json

import pytest


@pytest.fixture(scope="module")
def agent_world():
    from asyncgrpo.toy.agent_world import build_agent_world

    return build_agent_world()  # the default cache: built once per machine, like the toy world


def test_base_calls_the_tool_but_succeeds_well_below_one(agent_world):
    sampled = agent_world.base_sampled
    assert 0.05 <= sampled["success"] <= 0.7
    assert sampled["tool_calls_mean"] >= 0.5 and sampled["turns_mean"] > 1.0
    rows = agent_world.read_rows(heldout=True)
    assert len(rows) == agent_world.spec.n_heldout and {r["hops"] for r in rows} == {1, 2, 3, 4}


def test_saved_model_and_tokenizer_replay_the_recorded_base_figures(agent_world):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.toy.agent_episodes import heldout_success, run_episodes
    from asyncgrpo.toy.agent_task import LookupEnv, is_value

    tokenizer = AutoTokenizer.from_pretrained(agent_world.model_dir)
    model = AutoModelForCausalLM.from_pretrained(agent_world.model_dir)
    rows = agent_world.read_rows(heldout=True)
    tools = [LookupEnv().lookup]
    sampled = heldout_success(model, tokenizer, rows, seed=agent_world.spec.sample_seed)
    assert dataclasses.asdict(sampled) == pytest.approx(agent_world.base_sampled)
    # Token-exact continuation: each episode's ids are the template's rendering of its messages.
    episodes = run_episodes(model, tokenizer, rows[:20], seed=7)
    for row, episode in zip(rows[:20], episodes):
        messages = [*row["prompt"], *episode["messages"]]
        if episode["truncated"] or not is_value(episode["messages"][-1].get("content", "")):
            continue  # a cut-off or free-text turn does not re-render to the same ids
        rendered = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
        assert list(rendered) == episode["ids"]
    meta = json.loads((agent_world.root / "world.json").read_text())
    assert meta["key"] == agent_world.spec.key()
