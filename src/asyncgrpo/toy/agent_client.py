"""The toy agent written as a user would write one with the `openai` client: `run(row, base_url, model, api_key)`
plays one episode against any OpenAI-compatible endpoint (asyncgrpo's agent endpoint with `agent_function:
asyncgrpo.toy.agent_client:run`) and returns its reward. The same episode as `environment_factory: LookupEnv` runs:
the same tool, its errors worded the same way, at most MAX_TURNS model turns, `lookup_reward`'s rule."""

from __future__ import annotations

import json
from typing import Any

from asyncgrpo.toy.agent_task import LookupEnv, lookup_reward

MAX_TURNS = 5
"""Model turns per episode, as the agent demo's `max_turns` (chains have at most 4 hops: 4 calls + the answer)."""
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Follow the hidden chain one hop from where this episode stands.",
    "parameters": {"type": "object", "properties": {}}}}]
"""`LookupEnv.lookup` as an OpenAI tool (no arguments)."""


def run(row: dict[str, Any], base_url: str, model: str, api_key: str = "none") -> float:
    """One episode on `row` (a toy agent world row): call, run each `lookup`, call again until the model answers;
    1.0 when the answer is the chain's value, else 0.0 (also when the endpoint refuses a call: the budget is spent)."""
    import openai  # heavy, and only agents need it

    env = LookupEnv()
    env.reset(**row)
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[Any] = list(row["prompt"])
    for _ in range(MAX_TURNS):
        try:
            message = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        except openai.BadRequestError:  # the episode's token budget is spent: it ends unanswered
            return 0.0
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": _lookup(env, call.function.name)})
    episode = [m if isinstance(m, dict) else {"role": "assistant", "content": m.content, "tool_calls": m.tool_calls}
               for m in messages[len(row["prompt"]):]]
    return lookup_reward([episode], answer=[row["answer"]])[0]


def _lookup(env: LookupEnv, name: str) -> str:
    """The tool message of one call, worded as the episode runner words it."""
    if name != "lookup":
        return json.dumps({"error": f"no tool named {name!r}; tools: ['lookup']"})
    try:
        return env.lookup()
    except Exception as exc:  # noqa: BLE001 - the model reads it, as from the built-in loop
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"})
