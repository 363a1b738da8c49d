"""The agent endpoint's rules one call at a time, without HTTP: what a request may say (each field checked, refused
naming it, or read), how OpenAI messages become the chat template's, which sample a call continues, and the
answer's OpenAI shapes. The end-to-end path with the real `openai` client: test_capture.py."""

from __future__ import annotations

import json
import re

import pytest
from agent_format import agent_tokenizer
from fakes import cfg as make_cfg

from asyncgrpo.inference.client import Completion
from asyncgrpo.rollout.capture import (CaptureEpisode, CaptureRefused, ChatRequest, Sample, Turn, chat_response,
                                       check_chat_request, normalise_messages, openai_message, same_message,
                                       stream_chunks)
from asyncgrpo.rollout.episodes import ChatFormat, Episode

TOK = agent_tokenizer()
EOS = 0
USER = {"role": "user", "content": "find qx"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def check(**fields) -> ChatRequest:
    return check_chat_request({"model": "ep", "messages": [USER], **fields}, temperature=0.8, top_p=0.95)


def refused(**fields) -> CaptureRefused:
    with pytest.raises(CaptureRefused) as caught:
        check(**fields)
    return caught.value


# ---- the request ---------------------------------------------------------------------------------------------------
def test_a_checked_request_carries_what_the_call_said_and_defaults_for_what_it_left_out():
    plain = check()
    assert (plain.model, plain.messages, plain.tools) == ("ep", [{"role": "user", "content": "find qx"}], [])
    assert (plain.max_tokens, plain.stop, plain.stream, plain.include_usage, plain.seed) == (None, [], False, False,
                                                                                            None)
    full = check(tools=TOOLS, max_tokens=9, stop="##", stream=True, stream_options={"include_usage": True}, seed=3,
                 temperature=0.8, top_p=0.95, n=1, user="u", metadata={}, store=False, service_tier="auto",
                 parallel_tool_calls=True, logprobs=False, tool_choice="auto")
    assert (full.tools, full.max_tokens, full.stop, full.stream, full.include_usage, full.seed) == \
        (TOOLS, 9, ["##"], True, True, 3)
    assert check(stream=True, stream_options={"include_usage": False}).include_usage is False
    assert check(stop=["a", "b"]).stop == ["a", "b"]
    assert check(max_completion_tokens=4, max_tokens=9).max_tokens == 4  # OpenAI's newer name wins
    assert check_chat_request({"messages": [USER]}, temperature=1, top_p=1).model == ""


def test_the_config_temperature_and_top_p_are_accepted_within_a_rounding_and_anything_else_is_refused():
    assert check(temperature=0.8 + 5e-7, top_p=0.95 - 5e-7).model == "ep"
    for field, value in (("temperature", 0.8 + 2e-6), ("top_p", 0.95 - 2e-6), ("temperature", "0.8"),
                         ("top_p", [0.95])):
        error = refused(**{field: value})
        assert (error.status, error.param) == (400, field)
        assert f"{field}={value!r} differs from the training config's {field}" in error.message


@pytest.mark.parametrize("field, neutral, other", [("frequency_penalty", 0, 0.1), ("presence_penalty", 0, -0.1),
                                                   ("top_k", -1, 5), ("min_p", 0, 0.05),
                                                   ("repetition_penalty", 1, 1.1)])
def test_a_sampling_field_is_accepted_only_at_its_neutral_value(field, neutral, other):
    assert check(**{field: neutral}).model == "ep"
    error = refused(**{field: other})
    assert error.param == field and error.message.startswith(f"{field}={other!r} is refused")


def test_unknown_fields_are_all_named_and_the_first_in_order_is_the_param():
    error = refused(zeta=1, audio={}, modalities=["text"])
    assert error.param == "audio"
    assert error.message.startswith("audio, modalities, zeta not supported")


@pytest.mark.parametrize("fields, param, says", [
    ({"n": 2}, "n", "n=2 is refused"),
    ({"n": 0}, "n", "n=0 is refused"),
    ({"tool_choice": "none"}, "tool_choice", "tool_choice='none' is refused"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "parallel_tool_calls=false"),
    ({"logprobs": True}, "logprobs", "logprobs are not returned"),
    ({"tools": {"name": "lookup"}}, "tools", "tools must be a list"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "tools must be a list"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "tools must be a list"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools", "tools must be a list"),
    ({"tools": ["lookup"]}, "tools", "tools must be a list"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens=0 must be a positive integer"),
    ({"max_tokens": 2.0}, "max_tokens", "max_tokens=2.0 must be"),
    ({"max_tokens": True}, "max_tokens", "max_tokens=True must be"),
    ({"max_completion_tokens": -3}, "max_tokens", "max_tokens=-3 must be"),
    ({"stop": ""}, "stop", "stop must be a non-empty string"),
    ({"stop": ["a", ""]}, "stop", "stop must be"),
    ({"stop": ["a", 3]}, "stop", "stop must be"),
    ({"stop": 3}, "stop", "stop must be"),
    ({"seed": "3"}, "seed", "seed='3' must be an integer"),
    ({"seed": False}, "seed", "seed=False must be an integer"),
])
def test_each_field_the_endpoint_cannot_serve_as_sent_is_refused_naming_it(fields, param, says):
    error = refused(**fields)
    assert (error.status, error.param) == (400, param) and says in error.message


def test_max_tokens_of_one_and_a_seed_of_zero_are_kept():
    request = check(max_tokens=1, seed=0)
    assert (request.max_tokens, request.seed) == (1, 0)


def test_a_body_that_is_not_an_object_is_refused():
    for body in ([], "x", None):
        with pytest.raises(CaptureRefused, match="must be a JSON object") as caught:
            check_chat_request(body, temperature=1, top_p=1)
        assert caught.value.param == "" and caught.value.status == 400


def test_an_error_body_is_openais_shape_with_the_type_following_the_status():
    assert CaptureRefused(400, "bad", param="stop", code="c").body() == \
        {"error": {"message": "bad", "type": "invalid_request_error", "param": "stop", "code": "c"}}
    assert CaptureRefused(499, "x").body()["error"]["type"] == "invalid_request_error"
    assert CaptureRefused(500, "x").body()["error"] == {"message": "x", "type": "server_error", "param": None,
                                                       "code": None}
    assert str(CaptureRefused(502, "lost")) == "lost"


# ---- messages ------------------------------------------------------------------------------------------------------
def test_messages_must_be_a_non_empty_list_of_objects_with_a_known_role_named_by_index():
    for messages in (None, [], [USER, "hi"], {"role": "user"}):
        with pytest.raises(CaptureRefused, match="non-empty list of message objects") as caught:
            normalise_messages(messages)
        assert caught.value.param == "messages"
    with pytest.raises(CaptureRefused) as caught:
        normalise_messages([USER, {"role": "function", "content": "x"}])
    assert caught.value.param == "messages[1].role"
    assert caught.value.message == "role 'function' is not one of system, developer, user, assistant, tool"
    with pytest.raises(CaptureRefused) as caught:
        normalise_messages([USER, {"role": "user", "content": 5}])
    assert caught.value.param == "messages[1].content"


def test_every_role_is_kept_with_its_text_and_only_what_the_template_reads():
    messages = normalise_messages([
        {"role": "system", "content": "s", "name": "x"}, {"role": "developer", "content": [{"type": "text"}]},
        {"role": "user", "content": None},
        {"role": "assistant", "content": "a", "tool_calls": [], "refusal": None},
        {"role": "tool", "content": "r", "name": "lookup"}])
    assert messages == [{"role": "system", "content": "s"}, {"role": "developer", "content": ""},
                        {"role": "user", "content": None}, {"role": "assistant", "content": "a"},
                        {"role": "tool", "content": "r", "name": "lookup"}]


def test_a_tool_message_is_named_after_its_call_unless_it_names_itself_and_keeps_its_call_id():
    calls = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}},
             {"id": None, "type": "function", "function": {"name": "other", "arguments": None}},
             {"type": "function", "function": {"name": "third", "arguments": ""}}]
    messages = normalise_messages([
        USER, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c1", "name": "mine", "content": "2"},
        {"role": "tool", "tool_call_id": "zz", "content": "3"},
        {"role": "tool", "content": "4"}])
    assert messages[1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"key": "a"}}},
        {"id": None, "type": "function", "function": {"name": "other", "arguments": {}}},
        {"id": None, "type": "function", "function": {"name": "third", "arguments": {}}}]
    assert [(m["name"], m.get("tool_call_id")) for m in messages[2:]] == \
        [("lookup", "c1"), ("mine", "c1"), ("", "zz"), ("", None)]
    assert "tool_call_id" not in messages[5]


@pytest.mark.parametrize("call", [{"function": {"arguments": "{}"}}, {"function": "lookup"}, "lookup()",
                                  {"function": {"name": 5}}])
def test_a_tool_call_without_a_named_function_is_refused_naming_where(call):
    with pytest.raises(CaptureRefused) as caught:
        normalise_messages([USER, {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}, call]}])
    assert caught.value.param == "messages[1].tool_calls[1]"
    assert caught.value.message == \
        'a tool call must be {"type": "function", "function": {"name": ..., "arguments": ...}}'


def test_tool_call_arguments_that_are_not_json_are_refused_naming_the_call():
    with pytest.raises(CaptureRefused) as caught:
        normalise_messages([USER, {"role": "assistant", "tool_calls": [
            {"id": "a", "function": {"name": "f", "arguments": "{'key': 1}"}}]}])
    assert caught.value.param == "messages[1].tool_calls[0]"
    assert caught.value.message == "the arguments \"{'key': 1}\" are not JSON"


def test_text_parts_are_joined_and_a_part_without_text_is_empty():
    (message,) = normalise_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"},
                                                                  {"type": "text", "text": 7}]}])
    assert message["content"] == "a7"
    with pytest.raises(CaptureRefused, match="images and audio"):
        normalise_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}])


def test_the_same_turn_is_its_role_text_and_calls_whatever_its_ids():
    call = {"id": "x", "function": {"name": "lookup", "arguments": {"key": "a"}}}
    assert same_message({"role": "assistant", "content": None}, {"role": "assistant", "content": ""})
    assert same_message({"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "assistant", "tool_calls": [{**call, "id": "y"}], "reasoning_content": "r"})
    assert not same_message({"role": "assistant", "content": "a"}, {"role": "user", "content": "a"})
    assert not same_message({"role": "user", "content": "a"}, {"role": "user", "content": "b"})
    assert not same_message({"role": "assistant", "tool_calls": [call]}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "lookup", "arguments": {"key": "b"}}}]})


# ---- linking calls to samples --------------------------------------------------------------------------------------
def request(messages, tools=(), **values) -> ChatRequest:
    return ChatRequest(model="ep", messages=list(messages), tools=list(tools), max_tokens=values.get("max_tokens"),
                       stop=values.get("stop", []), stream=False, include_usage=False, seed=values.get("seed"))


ANSWER = {"role": "assistant", "content": "45"}
TOOL = {"role": "tool", "content": "[2]", "name": "lookup"}


def test_a_sample_is_extended_only_by_a_longer_call_with_its_tools_that_starts_with_its_record():
    sample = Sample(Episode([USER], [], {}, []), record=[USER, ANSWER], tools=[], continuable=True)
    assert sample.extended_by(request([USER, ANSWER, TOOL]))
    assert not sample.extended_by(request([USER, ANSWER]))  # nothing after the record
    assert not sample.extended_by(request([USER, {"role": "assistant", "content": "46"}, TOOL]))
    assert not sample.extended_by(request([USER, ANSWER, TOOL], tools=TOOLS))
    sample.busy = True
    assert not sample.extended_by(request([USER, ANSWER, TOOL]))
    sample.busy, sample.continuable = False, False
    assert not sample.extended_by(request([USER, ANSWER, TOOL]))


class Client:
    """Answers every request with `text` + eos (or cut at max_tokens as `length`), logprob -0.5 a token; records what
    each request asked for."""

    def __init__(self, text="45", finish="stop", end=True):
        self.text, self.finish, self.end = text, finish, end
        self.calls: list[dict] = []

    def complete(self, model, prompt_ids, *, n, max_tokens, temperature, top_p, seed, extra=None):
        self.calls.append({"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "seed": seed,
                           "temperature": temperature, "top_p": top_p, "extra": extra, "n": n})
        sampled = (ids(self.text) + ([EOS] if self.end else []))
        finish = "length" if len(sampled) > max_tokens else self.finish
        sampled = sampled[:max_tokens]
        return [Completion(sampled, [-0.5] * len(sampled), self.text, finish, model)]


def capture(client, *, seed=None, max_model_len=256, latest=None, **values) -> CaptureEpisode:
    cfg = make_cfg(num_generations=2, agent_function="agent_fns:three_turns", max_completion_length=20,
                   temperature=0.8, **values)
    return CaptureEpisode("ep", ChatFormat(TOK, TOK.response_template, stop_ids={EOS}), cfg, client,
                          adapter="pol-v3", version=3, seed=seed, max_model_len=max_model_len, latest=latest)


def test_a_call_is_sampled_on_the_config_and_the_episodes_adapter_with_a_seed_per_call():
    client = Client()
    e = capture(client, seed=11)
    turn = e.chat(request([USER]))
    (call,) = client.calls
    assert (call["model"], call["temperature"], call["top_p"], call["n"]) == ("pol-v3", 0.8, 1.0, 1)
    assert call["seed"] == (11 + 7919 * 1) % 2**31 and call["extra"] is None and call["max_tokens"] == 20
    assert call["prompt"] == e.fmt.render([USER], [], generation_prompt=True)
    assert (turn.prompt_tokens, turn.completion_tokens) == (len(call["prompt"]), 3)
    e.chat(request([USER, openai_back(turn.message), TOOL]))
    assert client.calls[1]["seed"] == (11 + 7919 * 2) % 2**31
    e.chat(request([{"role": "user", "content": "other"}], seed=5, stop=["#"]))
    assert client.calls[2]["seed"] == 5 and client.calls[2]["extra"] == {"stop": ["#"]}
    unseeded = Client()
    capture(unseeded).chat(request([USER]))
    assert unseeded.calls[0]["seed"] is None


def test_a_seed_wraps_at_two_to_the_31():
    client = Client()
    capture(client, seed=2**31 - 1).chat(request([USER]))
    assert client.calls[0]["seed"] == (2**31 - 1 + 7919) % 2**31 == 7918


def openai_back(message: dict) -> dict:
    """An answer as the agent sends it back (arguments as JSON strings), normalised as the endpoint would."""
    return normalise_messages([message])[0]


def test_each_call_records_the_turn_and_the_answer_continues_only_after_an_end_of_turn_id():
    client = Client("45")
    e = capture(client)
    first = e.chat(request([USER], tools=TOOLS))
    (sample,) = e.samples
    assert first.finish_reason == "tool_calls" and sample.continuable and not sample.busy
    assert sample.record[0] == USER and sample.record[1]["tool_calls"][0]["function"]["arguments"] == {"key": "45"}
    (call,) = sample.record[1]["tool_calls"]
    assert call["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert first.message["tool_calls"][0]["id"] == call["id"]
    assert sample.episode.turns == 1 and sample.episode.finish_reason == "stop" and e.calls == 1
    assert sample.episode.messages == [sample.record[1]]
    # a stop string leaves no end-of-turn id: not continued (the next call starts a new sample), finish as parsed
    e2 = capture(Client("7", end=False))
    turn = e2.chat(request([USER], stop=["#"]))
    assert turn.finish_reason == "tool_calls" and not e2.samples[0].continuable
    assert e2.samples[0].episode.finish_reason == "stop"
    e3 = capture(Client("", end=False))
    turn = e3.chat(request([USER], stop=["#"]))
    assert turn.finish_reason == "stop" and not e3.samples[0].continuable and turn.completion_tokens == 0


def test_a_turn_cut_at_max_tokens_is_length_and_a_turn_with_no_call_is_stop():
    e = capture(Client("4567"))
    turn = e.chat(request([USER], max_tokens=2))
    assert turn.finish_reason == "length" and e.samples[0].episode.finish_reason == "length"
    assert not e.samples[0].continuable and turn.completion_tokens == 2
    plain = capture(Client(""))
    turn = plain.chat(request([USER]))
    assert turn.finish_reason == "stop" and turn.message == {"role": "assistant", "content": ""}
    assert plain.samples[0].continuable  # it ended on eos


def test_the_longest_recorded_conversation_a_call_extends_is_the_one_continued():
    client = Client("45")
    e = capture(client)
    t1 = e.chat(request([USER]))
    m1 = openai_back(t1.message)
    t2 = e.chat(request([USER, m1, TOOL]))
    m2 = openai_back(t2.message)
    assert len(e.samples) == 1
    # a fresh conversation opens a second sample; a call extending the first sample's longer record goes to it
    e.chat(request([{"role": "user", "content": "other"}]))
    assert len(e.samples) == 2 and e.splits == 1
    e.chat(request([USER, m1, TOOL, m2, TOOL]))
    assert len(e.samples) == 2 and e.samples[0].episode.turns == 3 and e.calls == 4
    assert len(e.samples[0].record) == 6


def test_a_call_that_ends_on_an_assistant_message_or_comes_after_a_fault_is_refused():
    e = capture(Client())
    with pytest.raises(CaptureRefused, match="prefilled assistant turn") as caught:
        e.chat(request([USER, ANSWER]))
    assert caught.value.status == 400 and e.calls == 0 and not e.samples
    e.fault = RuntimeError("down")
    with pytest.raises(CaptureRefused, match=r"this episode was lost \(down\)") as caught:
        e.chat(request([USER]))
    assert (caught.value.status, caught.value.code) == (410, "episode_lost") and not e.samples


def test_a_server_fault_is_kept_once_and_answered_502():
    class Down(Client):
        def complete(self, *args, **kwargs):
            raise ConnectionError("refused")

    e = capture(Down())
    with pytest.raises(CaptureRefused) as caught:
        e.chat(request([USER]))
    assert (caught.value.status, caught.value.code) == (502, "episode_lost")
    assert caught.value.message == "the inference server failed (refused); this episode is sent again"
    assert isinstance(e.fault, ConnectionError) and not e.samples[0].busy
    first = e.fault
    e._lose(ValueError("later"))
    assert e.fault is first


def test_a_conversation_past_the_token_budget_is_refused_and_ends_its_sample_truncated():
    e = capture(Client("4567"), max_episode_tokens=8)
    t1 = e.chat(request([USER]))
    assert t1.completion_tokens == 5  # 4 ids and eos
    with pytest.raises(CaptureRefused) as caught:
        e.chat(request([USER, openai_back(t1.message), TOOL]))
    assert caught.value.code == "context_length_exceeded" and "max_episode_tokens=8" in caught.value.message
    assert caught.value.param == "messages"
    (sample,) = e.samples
    assert sample.episode.finish_reason == "length" and not sample.continuable


def test_the_room_of_a_call_is_its_max_tokens_within_the_turn_and_the_episode_budgets():
    client = Client("4")
    e = capture(client, max_episode_tokens=12)
    e.chat(request([USER], max_tokens=30))
    assert client.calls[0]["max_tokens"] == 12  # max_completion_length 20, the episode's 12
    e2 = capture(client)
    e2.chat(request([USER], max_tokens=30))
    assert client.calls[1]["max_tokens"] == 20
    prompt = len(e.fmt.render([USER], [], generation_prompt=True))
    e3 = capture(client, max_model_len=prompt + 3)
    e3.chat(request([USER]))
    assert client.calls[2]["max_tokens"] == 3
    e4 = capture(client, max_model_len=prompt)
    with pytest.raises(CaptureRefused, match="no room to sample within max_model_len") as caught:
        e4.chat(request([USER]))
    assert caught.value.code == "context_length_exceeded" and len(client.calls) == 3
    assert caught.value.param == "messages"
    capture(client, max_model_len=prompt + 1).chat(request([USER]))  # one token of room is still sampled
    assert client.calls[3]["max_tokens"] == 1
    e5 = capture(client, max_model_len=None)
    e5.chat(request([USER], max_tokens=7))
    assert client.calls[4]["max_tokens"] == 7


def test_a_continued_call_appends_the_tool_suffix_as_context_tagged_with_the_last_version():
    client = Client("45")
    e = capture(client)
    m1 = openai_back(e.chat(request([USER])).message)
    s = e.samples[0].episode
    s.versions[-1] = 5  # as a `latest` turn would have tagged it
    e.chat(request([USER, m1, TOOL]))
    context = [v for v, m in zip(s.versions, s.loss_mask) if not m]
    assert context and set(context) == {5}
    assert s.messages[1] == TOOL and len(s.messages) == 3


def test_latest_samples_each_call_on_what_it_gives_and_tags_the_tokens_with_its_version():
    import contextlib

    held = []

    @contextlib.contextmanager
    def latest():
        held.append("in")
        yield 7, "pol-v7"
        held.append("out")

    client = Client("45")
    e = capture(client, latest=latest)
    e.chat(request([USER]))
    assert client.calls[0]["model"] == "pol-v7" and held == ["in", "out"]
    assert set(e.samples[0].episode.versions) == {7}


def test_an_aborted_call_loses_the_episode():
    e = capture(Client(finish="abort", end=False))
    with pytest.raises(CaptureRefused, match="aborted") as caught:
        e.chat(request([USER]))
    assert (caught.value.status, caught.value.code) == (410, "episode_lost")
    assert caught.value.message == "a weight sync aborted this call; the episode is sent again"
    assert "call 1 of ep was aborted" in str(e.fault)


# ---- answers -------------------------------------------------------------------------------------------------------
def test_an_answer_is_openais_message_with_json_arguments_and_empty_content_only_without_calls():
    calls = [{"id": "c1", "function": {"name": "lookup", "arguments": {"key": "é"}}}]
    assert openai_message({"content": "", "tool_calls": calls, "reasoning_content": "think"}) == {
        "role": "assistant", "content": None, "reasoning_content": "think",
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"key": "é"})}}]}
    assert openai_message({"content": "hi", "reasoning_content": ""}) == {"role": "assistant", "content": "hi"}
    assert openai_message({}) == {"role": "assistant", "content": ""}


TURN = Turn(message={"role": "assistant", "content": "7", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
    finish_reason="tool_calls", prompt_tokens=10, completion_tokens=3)


def test_a_chat_response_and_its_chunks_carry_the_model_the_message_and_the_usage():
    body = chat_response("ep", TURN)
    assert body["object"] == "chat.completion" and body["model"] == "ep" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": TURN.message, "finish_reason": "tool_calls", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert isinstance(body["created"], int) and body["created"] > 1_700_000_000
    chunks = stream_chunks("ep", TURN, include_usage=True)
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "ep" for c in chunks)
    assert all(isinstance(c["created"], int) and c["created"] > 1_700_000_000 for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "delta": {"role": "assistant", "content": "7"}, "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {"tool_calls": [{"index": 0, **TURN.message["tool_calls"][0]}]},
          "finish_reason": None, "logprobs": None}],
        [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}],
        []]
    assert chunks[-1]["usage"] == body["usage"]
    plain = stream_chunks("ep", Turn({"role": "assistant", "content": None}, "stop", 1, 1), include_usage=False)
    assert [c["choices"][0]["delta"] for c in plain] == [{"role": "assistant", "content": ""}, {}]
    assert "usage" not in plain[-1]


def test_a_continued_call_has_the_room_its_budgets_leave_after_the_turns_so_far_and_the_tool_suffix():
    def two_calls(client, **values):
        e = capture(client, **values)
        t1 = e.chat(request([USER]))
        return e, e.chat(request([USER, openai_back(t1.message), TOOL]))

    client = Client("45")  # each turn: 2 ids and eos
    e, _ = two_calls(client, max_model_len=None)
    suffix = len(e.samples[0].episode.ids) - 3 - 3  # the tool message's ids between the two turns
    prompt = len(e.samples[0].episode.prompt_ids)
    assert suffix > 0 and client.calls[1]["max_tokens"] == 20
    two_calls(client, max_episode_tokens=3 + suffix + 5, max_model_len=None)
    assert client.calls[3]["max_tokens"] == 5
    two_calls(client, max_model_len=prompt + 3 + suffix + 4)
    assert client.calls[5]["max_tokens"] == 4
    two_calls(client, max_model_len=prompt + 3 + suffix + 1)  # one token of room after the tool message: sampled
    assert client.calls[7]["max_tokens"] == 1
    # room before the tool message, none after it: refused as over the budget, the sample ends truncated
    with pytest.raises(CaptureRefused, match="has reached the episode's token budget"):
        two_calls(client, max_model_len=prompt + 3 + suffix)
    assert len(client.calls) == 9  # its first call only
