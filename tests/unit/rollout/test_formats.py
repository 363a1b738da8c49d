"""Tool calls and tool messages in two real formats, rendered and parsed the way episodes do (rollout/episodes.py):
a Qwen3/Hermes `<tool_call>` template (results in a `user` turn) and a Gemma 4 template (results inside the model
turn, which stops at `<|tool_response>`). Both chat templates and response templates are tests/tool_formats.py's,
written from the formats' documented tokens on a byte tokenizer with those tokens added as specials (the real
vocabularies are not needed to check where the ids are cut)."""

from __future__ import annotations

import pytest
from tool_formats import (GEMMA_RESPONSE, GEMMA_SPECIALS, GEMMA_TEMPLATE, QWEN_RESPONSE, QWEN_SPECIALS,
                          QWEN_TEMPLATE, get_weather, tokenizer)

from asyncgrpo.data import PromptRow
from asyncgrpo.inference.client import Completion
from asyncgrpo.rollout.episodes import ChatFormat, EpisodeRunner


def special(tok, name: str) -> int:
    return tok.convert_tokens_to_ids(name)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def qwen():
    tok = tokenizer(QWEN_SPECIALS, QWEN_TEMPLATE, QWEN_RESPONSE)
    return tok, ChatFormat(tok, QWEN_RESPONSE, stop_ids={special(tok, "<|im_end|>"), tok.eos_token_id})


@pytest.fixture(scope="module")
def gemma():
    tok = tokenizer(GEMMA_SPECIALS, GEMMA_TEMPLATE, GEMMA_RESPONSE)
    stops = {special(tok, "<eos>"), special(tok, "<|tool_response>"), special(tok, "<turn|>")}
    return tok, ChatFormat(tok, GEMMA_RESPONSE, stop_ids=stops)


MESSAGES = [{"role": "user", "content": "Weather?"}]


def test_qwen3_a_sampled_call_parses_with_its_reasoning_and_typed_arguments(qwen):
    tok, fmt = qwen
    prompt = fmt.prompt_ids(MESSAGES, [])
    sampled = encode(tok, '<think>\nneed tool\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                          '{"city": "Paris", "days": "3"}}\n</tool_call><|im_end|>')
    message = fmt.parse(prompt, sampled, [get_weather])
    assert message["reasoning_content"] == "need tool"
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                       "arguments": {"city": "Paris", "days": 3}}}]


def test_qwen3_two_tool_results_share_one_user_turn_after_the_sampled_im_end(qwen):
    tok, fmt = qwen
    call = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": c, "days": 1}}}
        for c in ("Paris", "Oslo")]}
    results = [{"role": "tool", "name": "get_weather", "content": "sunny"},
               {"role": "tool", "name": "get_weather", "content": "rain"}]
    suffix = fmt.tool_suffix(call, results, [])
    assert tok.decode(suffix) == ("\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n"
                                  "rain\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_gemma4_a_call_parses_and_the_result_continues_inside_the_model_turn(gemma):
    tok, fmt = gemma
    prompt = fmt.prompt_ids(MESSAGES, [])
    assert tok.decode(prompt).endswith("<|turn>user\nWeather?<turn|>\n<|turn>model\n")
    sampled = encode(tok, '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|><|tool_response>')
    message = fmt.parse(prompt, sampled, [get_weather])
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                       "arguments": {"city": "Paris", "days": 3}}}]
    suffix = fmt.tool_suffix(message, [{"role": "tool", "name": "get_weather", "content": "sunny"}], [])
    # the model stopped at <|tool_response>: the suffix starts at `response:`, and no new turn is opened
    assert tok.decode(suffix) == 'response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'


class Scripted:
    def __init__(self, tok, turns):
        self.tok, self.turns, self.prompts = tok, turns, []
        self.base_url = "http://scripted"

    def complete(self, model, prompt_ids, *, n, max_tokens, temperature, top_p, seed):
        sampled = encode(self.tok, self.turns[len(self.prompts)])
        self.prompts.append(list(prompt_ids))
        return [Completion(sampled, [-0.5] * len(sampled), "", "stop", model)]


@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_a_two_turn_episode_in_each_format_continues_on_the_exact_ids(name, request):
    from fakes import cfg as make_cfg

    tok, fmt = request.getfixturevalue(name)
    if name == "qwen":
        turns = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
                 '<|im_end|>', "It rains.<|im_end|>"]
    else:
        turns = ['<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:2}<tool_call|><|tool_response>',
                 "It rains.<turn|>"]
    cfg = make_cfg(tools=["x:get_weather"], max_turns=4)
    runner = EpisodeRunner(fmt, cfg, tools=[get_weather], factory=None, max_model_len=None)
    row = PromptRow(prompt=MESSAGES, prompt_ids=[], columns={}, rendered="")
    e = runner.start(row)
    client = Scripted(tok, turns)
    runner.run(client, e, adapter="a", version=2, seed=None)
    first = encode(tok, turns[0])
    assert client.prompts[1][:len(e.prompt_ids) + len(first)] == e.prompt_ids + first
    assert e.turns == 2 and e.tool_calls == 1 and e.tool_errors == 0
    assert e.messages[1] == {"role": "tool", "name": "get_weather", "content": "rain"}
    assert e.messages[2]["content"] == "It rains."
    assert sum(e.loss_mask) == len(first) + len(encode(tok, turns[1]))
    assert "get_weather" in tok.decode(e.prompt_ids)  # the tool schema is in the prompt
