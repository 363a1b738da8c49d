"""Agent functions for the agent endpoint's tests, written with the real `openai` client against the format of
tests/agent_format.py (every non-empty turn is a `lookup` call whose key is the turn's text)."""

from __future__ import annotations

import json
import threading

import openai

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}]


def play(base_url: str, model: str, turns: int = 3, first: str = "find qx") -> list[dict]:
    """Up to `turns` calls, each tool call answered `[len(key)]`; the messages at the end."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages: list = [{"role": "user", "content": first}]
    for _ in range(turns):
        choice = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0]
        message = choice.message
        messages.append(message)
        if choice.finish_reason != "tool_calls":  # a turn cut at max_tokens is not answered: the agent stops
            break
        for call in message.tool_calls:
            key = json.loads(call.function.arguments).get("key", "")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"[{len(key)}]"})
    return messages


def three_turns(row, base_url, model):
    play(base_url, model)
    return 1.0


async def three_turns_async(row, base_url, model):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages: list = [{"role": "user", "content": "find qx"}]
    for _ in range(3):
        choice = (await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)).choices[0]
        message = choice.message
        messages.append(message)
        if choice.finish_reason != "tool_calls":
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "[2]"})
    return float(len(messages))


_FIRST = threading.Lock()  # held for good by the first episode that takes it


def splits_first(row, base_url, model):
    """The first episode to run holds two separate conversations (the second cannot extend the first), the others
    one."""
    play(base_url, model, turns=1)
    if _FIRST.acquire(blocking=False):
        play(base_url, model, turns=1, first="find zz")
    return 1.0


def returns_dict(row, base_url, model):
    play(base_url, model, turns=1)
    return {"answer_seen": row["answer"], "calls": 1}


def reads_answer(prompts, completions, answer_seen, **kwargs):
    return [0.5 if a == "7" else 0.0 for a in answer_seen]


def raises(row, base_url, model):
    play(base_url, model, turns=1)
    raise ValueError("no luck")


def no_call(row, base_url, model):
    return 1.0


def returns_text(row, base_url, model):
    play(base_url, model, turns=1)
    return "solved"


def swallows_errors(row, base_url, model):
    try:
        play(base_url, model, turns=1)
    except openai.APIError:
        pass
    return 0.0
