"""The agent endpoint on scripted server answers (a stand-in for vLLM, whose own answers the integration test uses):
calls of one episode made with the real `openai` client are continued on the exact sampled ids, a call that does not
extend a sample starts a new one (counted), what the trainer cannot model is refused with a 400 naming the field,
`stream: true` works, and a group's advantages are its episodes'. The format is tests/agent_format.py's: every
non-empty turn is a `lookup` call whose key is the turn's text."""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest
from agent_format import agent_tokenizer
from fakes import cfg as make_cfg

from asyncgrpo.data import PromptRow
from asyncgrpo.errors import AgentFunctionError, ServerUnreachableError
from asyncgrpo.inference.client import Completion
from asyncgrpo.rollout.agent_endpoint import AgentEndpoint
from asyncgrpo.rollout.agent_runner import AgentRunner, call_agent
from asyncgrpo.rollout.capture import CaptureEpisode, CaptureRefused, check_chat_request, normalise_messages
from asyncgrpo.rollout.episodes import ChatFormat, TurnAborted

TOK = agent_tokenizer()
EOS = 0
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}]
ROW = PromptRow(prompt=[{"role": "user", "content": "find qx"}], prompt_ids=[], columns={"answer": "7"},
                rendered="find qx")


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class Scripted:
    """Answers the k-th request with `turns[k]` (text + eos unless `stop_string` is set: then as a stop string
    would leave it, without eos), logprob -0.5 per token; records each request's prompt ids and adapter."""

    def __init__(self, turns: list[str], fault: BaseException | None = None, finish: str = "stop"):
        self.turns, self.fault, self.finish = turns, fault, finish
        self.prompts, self.adapters, self.extras, self.max_tokens = [], [], [], []
        self.base_url = "http://scripted"

    def complete(self, model, prompt_ids, *, n, max_tokens, temperature, top_p, seed, extra=None):
        if self.fault is not None:
            raise self.fault
        text = self.turns[min(len(self.prompts), len(self.turns) - 1)]
        self.prompts.append(list(prompt_ids))
        self.adapters.append(model)
        self.max_tokens.append(max_tokens)
        self.extras.append(extra)
        sampled = ids(text) + ([EOS] if self.finish == "stop" and not extra else [])
        finish = "length" if len(sampled) > max_tokens else self.finish
        return [Completion(sampled[:max_tokens], [-0.5] * len(sampled[:max_tokens]), text, finish, model)]


def config(**values):
    return make_cfg(num_generations=2, agent_function="agent_fns:three_turns", max_completion_length=20,
                    **values)


@pytest.fixture
def endpoint():
    e = AgentEndpoint("127.0.0.1", 0, temperature=1.0, top_p=1.0)
    yield e
    e.close()


def episode(client, name="ep-1", **values) -> CaptureEpisode:
    return CaptureEpisode(name, ChatFormat(TOK, TOK.response_template, stop_ids={EOS}), config(**values), client,
                          adapter="pol-v3", version=3, seed=None, max_model_len=256)


def openai_client(endpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url, api_key="none", max_retries=0)


def tool_turns(client: openai.OpenAI, model: str, turns: int, **kwargs) -> list:
    """An agent written with the openai client: call, answer each tool call, call again."""
    messages = [{"role": "user", "content": "find qx"}]
    answers = []
    for _ in range(turns):
        answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, **kwargs)
        message = answer.choices[0].message
        answers.append(answer)
        messages.append(message)  # the pydantic object itself, as agents usually do
        for call in message.tool_calls or []:
            key = json.loads(call.function.arguments)["key"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"[{len(key)}]"})
    return answers


def test_calls_that_extend_the_recorded_conversation_continue_on_the_exact_sampled_ids(endpoint):
    scripted = Scripted(["45", "7", ""])
    e = episode(scripted)
    endpoint.register(e)
    answers = tool_turns(openai_client(endpoint), e.name, 3)
    assert [a.choices[0].finish_reason for a in answers] == ["tool_calls", "tool_calls", "stop"]
    call = answers[0].choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"key": "45"})
    (sample,) = e.samples
    s = sample.episode
    fmt = e.fmt
    first = fmt.render([{"role": "user", "content": "find qx"}], TOOLS, generation_prompt=True)
    assert scripted.prompts[0] == first
    # Each later prompt is the earlier one, the exact sampled ids, then the template's ids after the turn's stop
    for k in (1, 2):
        previous = scripted.prompts[k - 1]
        sampled = ids(["45", "7"][k - 1]) + [EOS]
        assert scripted.prompts[k][:len(previous) + len(sampled)] == previous + sampled
    suffix = scripted.prompts[1][len(scripted.prompts[0]) + 3:]
    assert TOK.decode(suffix) == "\n<|im_start|>tool\n[2]<|im_end|>\n<|im_start|>assistant\n"
    # The sample: every sampled id with mask 1 and its logprob and version; template/tool ids mask 0, logprob 0.0
    sampled_ids = ids("45") + [EOS] + ids("7") + [EOS] + [EOS]
    assert [t for t, m in zip(s.ids, s.loss_mask) if m] == sampled_ids
    assert [lp for lp, m in zip(s.logprobs, s.loss_mask) if m] == [-0.5] * len(sampled_ids)
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m) and s.loss_mask.count(0) > 0
    assert set(s.versions) == {3} and scripted.adapters == ["pol-v3"] * 3
    assert s.prompt_ids + s.ids == scripted.prompts[2] + [EOS]
    assert e.splits == 0 and e.calls == 3 and s.turns == 3
    assert [m["role"] for m in s.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]


def test_a_call_that_does_not_extend_a_sample_starts_a_new_one_and_is_counted(endpoint):
    scripted = Scripted(["45", "7"])
    e = episode(scripted)
    endpoint.register(e)
    client = openai_client(endpoint)
    first = client.chat.completions.create(model=e.name, messages=[{"role": "user", "content": "find qx"}],
                                           tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    edited = {"role": "assistant", "content": None,
              "tool_calls": [{"id": call.id, "type": "function",
                              "function": {"name": "lookup", "arguments": '{"key": "46"}'}}]}  # not what it sampled
    client.chat.completions.create(model=e.name, tools=TOOLS, messages=[
        {"role": "user", "content": "find qx"}, edited, {"role": "tool", "tool_call_id": call.id, "content": "[2]"}])
    assert len(e.samples) == 2 and e.splits == 1
    # the new sample is the whole conversation rendered by the template, its edited call context (mask 0)
    second = e.samples[1].episode
    assert second.prompt_ids == scripted.prompts[1] and "46" in TOK.decode(second.prompt_ids)
    assert sum(second.loss_mask) == len(ids("7")) + 1


def test_a_turn_cut_by_a_stop_string_is_not_continued_since_no_end_of_turn_id_follows_it(endpoint):
    scripted = Scripted(["45"], finish="stop")
    e = episode(scripted)
    endpoint.register(e)
    tool_turns(openai_client(endpoint), e.name, 2, stop=["5"])
    assert scripted.extras[0] == {"stop": ["5"]}
    assert len(e.samples) == 2 and e.splits == 1 and not e.samples[0].continuable


@pytest.mark.parametrize("field, value, says", [
    ("temperature", 0.7, "differs from the training config's temperature (1.0)"),
    ("top_p", 0.9, "differs from the training config's top_p"),
    ("n", 2, "one choice per call"),
    ("tool_choice", "required", "constrained decoding"),
    ("tool_choice", {"type": "function", "function": {"name": "lookup"}}, "constrained decoding"),
    ("frequency_penalty", 0.5, "behaviour logprobs"),
    ("logit_bias", {"5": 10}, "not supported"),
    ("response_format", {"type": "json_object"}, "not supported"),
    ("logprobs", True, "not returned"),
    ("parallel_tool_calls", False, "cannot be enforced"),
])
def test_what_the_trainer_could_not_model_is_refused_with_a_400_naming_the_field(endpoint, field, value, says):
    e = episode(Scripted(["45"]))
    endpoint.register(e)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(endpoint).chat.completions.create(model=e.name, messages=[{"role": "user", "content": "x"}],
                                                        **{field: value})
    assert caught.value.status_code == 400 and says in caught.value.message
    assert caught.value.body["param"] == field and e.calls == 0


def test_the_config_values_and_neutral_ones_are_accepted_and_max_tokens_is_honoured_within_the_turn_budget(
        endpoint):
    scripted = Scripted(["4567"])
    e = episode(scripted)
    endpoint.register(e)
    answer = openai_client(endpoint).chat.completions.create(
        model=e.name, messages=[{"role": "user", "content": "x"}], temperature=1.0, top_p=1.0, n=1,
        frequency_penalty=0, presence_penalty=0.0, tool_choice="auto", max_completion_tokens=2, seed=5)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 2
    assert e.samples[0].episode.finish_reason == "length"  # truncated: mask_truncated_completions applies
    assert scripted.max_tokens == [2]
    request = check_chat_request({"model": "ep-2", "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 999}, temperature=1.0, top_p=1.0)
    scripted2 = Scripted(["45"])
    episode(scripted2, name="ep-2").chat(request)
    assert scripted2.max_tokens == [20]  # capped at max_completion_length


def test_stream_true_gives_the_same_answer_as_chunks(endpoint):
    e = episode(Scripted(["45"]))
    endpoint.register(e)
    stream = openai_client(endpoint).chat.completions.create(
        model=e.name, messages=[{"role": "user", "content": "find qx"}], tools=TOOLS, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("lookup", {"key": "45"})]
    assert [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason] == \
        ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == 3


def test_an_unknown_model_is_a_404_and_a_keyed_endpoint_refuses_a_wrong_key():
    keyed = AgentEndpoint("127.0.0.1", 0, temperature=1.0, top_p=1.0, key="s3cret")
    try:
        e = episode(Scripted(["45"]))
        keyed.register(e)
        wrong = openai.OpenAI(base_url=keyed.base_url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model=e.name, messages=[{"role": "user", "content": "x"}])
        right = openai.OpenAI(base_url=keyed.base_url, api_key="s3cret", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="not a live episode"):
            right.chat.completions.create(model="nobody", messages=[{"role": "user", "content": "x"}])
        assert [m.id for m in right.models.list()] == [e.name]
        assert right.chat.completions.create(model=e.name, messages=[{"role": "user", "content": "x"}]).choices
    finally:
        keyed.close()


def test_openai_messages_are_normalised_for_the_template_and_tool_messages_get_the_calls_name():
    messages = normalise_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "qx"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-> rk"}])
    assert messages[0]["content"] == "ab"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"key": "qx"}
    assert messages[2]["name"] == "lookup"
    with pytest.raises(CaptureRefused, match="not JSON"):
        normalise_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
    with pytest.raises(CaptureRefused, match="images"):
        normalise_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# ---- the runner --------------------------------------------------------------------------------------------------
def runner(endpoint, **values) -> AgentRunner:
    import agent_fns

    return AgentRunner(ChatFormat(TOK, TOK.response_template, stop_ids={EOS}), config(**values),
                       agent=values.pop("agent", agent_fns.three_turns), endpoint=endpoint, max_model_len=256)


def test_a_group_is_every_sample_of_its_episodes_with_each_episodes_reward_and_advantage(endpoint):
    import agent_fns

    r = runner(endpoint)
    r.agent = agent_fns.splits_first
    agent_fns._FIRST = threading.Lock()  # a fresh one: this test's first episode splits
    scripted = Scripted(["45", "7", ""])
    episodes = r.run_group(scripted, ROW, n=2, adapter="pol-v3", version=3, seed=0)
    assert sorted(len(e.samples) for e in episodes) == [1, 2]
    group = r.group(ROW, episodes, [1.0, 0.0], {"three_turns": [1.0, 0.0]}, index=4, version=3, adapter="pol-v3")
    owners = [i for i, e in enumerate(episodes) for _ in e.samples]
    assert len(group.completion_ids) == 3 and group.rewards == [[1.0, 0.0][i] for i in owners]
    # each episode's advantage (1 and 0 centred, over the unbiased std of two), not one over three samples
    assert group.advantages == pytest.approx([[0.7070, -0.7070][i] for i in owners], abs=1e-3)
    assert r.stats.values()["capture/new_samples_total"] == 1


def test_the_agents_float_is_its_reward_and_a_dict_reaches_the_reward_functions_as_columns(endpoint):
    from asyncgrpo.rollout.build import make_group_scorer
    import agent_fns

    r = runner(endpoint)
    episodes = r.run_group(Scripted(["45", "7", ""]), ROW, n=2, adapter="a", version=0, seed=None)
    rewards, parts = r.score(make_group_scorer(config(), TOK, None), ROW, episodes)
    assert rewards == [1.0, 1.0] and parts == {"three_turns": [1.0, 1.0]}
    r2 = runner(endpoint, reward_funcs=["agent_fns:reads_answer"])
    r2.agent = agent_fns.returns_dict
    episodes = r2.run_group(Scripted(["45", "7", ""]), ROW, n=2, adapter="a", version=0, seed=None)
    rewards, parts = r2.score(make_group_scorer(config(reward_funcs=["agent_fns:reads_answer"]), TOK, None), ROW,
                              episodes)
    assert rewards == [0.5, 0.5] and parts["reads_answer"] == [0.5, 0.5] and parts["three_turns"] == [None, None]


@pytest.mark.parametrize("agent, says", [("raises", "raised ValueError: no luck"),
                                         ("no_call", "made no call to the endpoint"),
                                         ("returns_text", "return the episode's reward"),
                                         ("returns_dict", "no reward_funcs are configured")])
def test_an_agent_that_breaks_its_episode_stops_the_run_naming_the_function(endpoint, agent, says):
    import agent_fns

    r = runner(endpoint)
    r.agent = getattr(agent_fns, agent)
    with pytest.raises(AgentFunctionError, match=says):
        r.run_group(Scripted(["45", "7", ""]), ROW, n=2, adapter="a", version=0, seed=None)


@pytest.mark.parametrize("fault", [ServerUnreachableError("down"), "abort"])
def test_a_server_fault_or_a_syncs_abort_is_raised_for_the_producer_whatever_the_agent_made_of_it(endpoint, fault):
    import agent_fns

    r = runner(endpoint)
    r.agent = agent_fns.swallows_errors
    scripted = Scripted(["45"], fault=None if fault == "abort" else fault, finish="abort")
    with pytest.raises(TurnAborted if fault == "abort" else ServerUnreachableError):
        r.run_group(scripted, ROW, n=2, adapter="a", version=0, seed=None)


def test_call_agent_passes_what_the_function_takes_and_runs_async_functions():
    def positional(row):
        return row["answer"]

    async def named(row, model, **kwargs):
        return (model, sorted(kwargs))

    assert call_agent(positional, {"answer": "7"}, base_url="u", model="m", api_key="k") == "7"
    assert call_agent(named, {}, base_url="u", model="m", api_key="k") == ("m", ["api_key", "base_url"])
    assert asyncio.iscoroutinefunction(named)
