"""build_episode_runner, the one place episodes are wired from the config: the tokenizer's response template (or the
one transformers ships for the model's type), the turns' stop ids from the tokenizer and generation_config.json, the
chat template's extra arguments and system prompt, the tools and the environment class, the server's context. And
build_producer: what it is given (a resumed batch, the episode runner) reaches the producer it builds."""

from __future__ import annotations

import copy
import json

import agent_tools
from agent_format import agent_tokenizer, lookup
from fakes import FakeVLLM, cfg

from asyncgrpo.data import PromptRow
from asyncgrpo.rollout.build import build_episode_runner, build_producer, make_group_scorer
from asyncgrpo.rollout.queue import RolloutQueue

TOK = agent_tokenizer()
ROW = PromptRow(prompt=[{"role": "user", "content": "07,45>"}], prompt_ids=[], columns={"start": 2},
                rendered="<rendered>")


def test_the_runner_gets_the_configs_tools_environment_template_arguments_system_prompt_and_stop_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    config = cfg(tools=["agent_format:lookup"], environment_factory="agent_tools:Counter",
                 chat_template_kwargs={"enable_thinking": False}, system_prompt="Be brief.")
    runner = build_episode_runner(config, TOK, str(tmp_path), 512)
    assert runner.cfg is config and runner.max_model_len == 512
    assert runner.fmt.stop_ids == {0, 5}  # the tokenizer's eos and generation_config.json's: where turns end
    assert runner.fmt.template_kwargs == {"enable_thinking": False}
    assert runner.fmt.response_template == TOK.response_template
    e = runner.start(ROW)
    assert isinstance(e.environment, agent_tools.Counter) and e.environment.count == 2
    assert list(e.tools) == ["lookup", "increment"] and e.tools["lookup"] is lookup  # the config's, then the class's
    assert TOK.decode(e.prompt_ids).startswith("<|im_start|>system\ntools: lookup increment<|im_end|>\n"
                                               "<|im_start|>system\nBe brief.<|im_end|>\n")


def test_a_tokenizer_without_a_response_template_gets_the_one_transformers_ships_for_the_models_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    tok = copy.deepcopy(TOK)
    tok.response_template = None
    runner = build_episode_runner(cfg(tools=["agent_format:lookup"]), tok, str(tmp_path), None)
    template = runner.fmt.response_template
    assert template["start_anchor"] == "<|im_start|>assistant\n" and "<tool_call>" in json.dumps(template)
    assert runner.factory is None and runner.fmt.stop_ids == {0}  # no generation_config.json: the tokenizer's eos


def test_build_producer_hands_the_resumed_batch_and_the_episode_runner_to_the_producer(tmp_path):
    config = cfg(tools=["agent_format:lookup"], reward_funcs=["agent_tools:messages_reward"], num_generations=2,
                 per_device_train_batch_size=4, max_staleness=0)
    runner = build_episode_runner(config, TOK, str(tmp_path), None)
    producer = build_producer(config, clients=[FakeVLLM()], rows=[ROW], scorer=make_group_scorer(config, TOK, None),
                              queue=RolloutQueue(0), groups_per_step=2, start_batch=3, episodes=runner)
    assert producer.episodes is runner  # with tools, completions are episodes
    schedule = producer.admission  # not started: its send rule is read directly
    schedule.set_policy(2, "a-v2")
    with schedule.cond:  # resumed at batch 3: with max_staleness 0, version 2 may not generate for it
        assert (schedule.next_batch(), schedule.may_send()) == (3, False)
    schedule.set_policy(3, "a-v3")
    with schedule.cond:
        assert schedule.may_send()
