"""Capture: an agent's own OpenAI chat calls, turned into token-exact training samples.

Each call is checked (what the trainer cannot model is refused), rendered with the chat template, sampled on vLLM as
token ids on the episode's adapter, and parsed back into an assistant message. A call whose messages extend a sample's
recorded conversation continues on that sample's exact ids; any other call starts a new sample. docs/agents.md,
"Your own agent".
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.config import AgentSettings, GenerationSettings
from asyncgrpo.rollout.episodes import ChatFormat, Episode, Latest, TurnAborted, tool_calls_of

ROLES = ("system", "developer", "user", "assistant", "tool")
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "top_k": -1, "min_p": 0, "repetition_penalty": 1}
"""Sampling fields accepted at their neutral value only: any other value changes the distribution sampled from."""
IGNORED = ("user", "metadata", "store", "stream_options", "parallel_tool_calls", "logprobs", "seed", "service_tier")
"""Fields read further below (or harmless: user, metadata, store, service_tier)."""
KNOWN = ("model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
         "stop", "stream", "n", *IGNORED, *NEUTRAL)
CHANGES_SAMPLING = ("the trainer scores the plain softmax at the config's temperature, so the behaviour logprobs of "
                    "tokens sampled otherwise would not be the trainer's")


class CaptureRefused(Exception):
    """A call the endpoint answers with an OpenAI-style error: `status`, the message, the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def refuse(param: str, message: str, code: str | None = None) -> CaptureRefused:
    return CaptureRefused(400, message, param=param, code=code)


# ---- one request ---------------------------------------------------------------------------------------------------
@dataclass
class ChatRequest:
    """A checked /v1/chat/completions body: what the endpoint does with it."""

    model: str
    messages: list[dict]  # in the chat template's form (normalise)
    tools: list[dict]  # OpenAI function tools, handed to the chat template as they are
    max_tokens: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    seed: int | None


def check_chat_request(body: Any, *, temperature: float, top_p: float) -> ChatRequest:
    """The request as the endpoint serves it, or CaptureRefused naming the field the trainer could not model."""
    if not isinstance(body, dict):
        raise refuse("", "the body must be a JSON object")
    unknown = sorted(set(body) - set(KNOWN))
    if unknown:
        raise refuse(unknown[0], f"{', '.join(unknown)} not supported by the asyncgrpo agent endpoint: leave them out")
    for key, neutral in NEUTRAL.items():
        if body.get(key) not in (None, neutral):
            raise refuse(key, f"{key}={body[key]!r} is refused: {CHANGES_SAMPLING}. Leave it out")
    for key, expected in (("temperature", temperature), ("top_p", top_p)):
        value = body.get(key)
        if value is not None and (not isinstance(value, (int, float)) or abs(value - expected) > 1e-6):
            raise refuse(key, f"{key}={value!r} differs from the training config's {key} ({expected}): {CHANGES_SAMPLING}."
                         f" Leave it out or send {expected}")
    if body.get("n") not in (None, 1):
        raise refuse("n", f"n={body['n']!r} is refused: one choice per call (call again for another sample)")
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise refuse("tool_choice", f"tool_choice={choice!r} is refused: forcing or forbidding calls needs constrained "
                     f"decoding, which {CHANGES_SAMPLING}. Leave it out or send \"auto\"")
    if body.get("parallel_tool_calls") is False:
        raise refuse("parallel_tool_calls", "parallel_tool_calls=false cannot be enforced without constrained "
                     "decoding; leave it out and run the calls one at a time if you must")
    if body.get("logprobs"):
        raise refuse("logprobs", "logprobs are not returned by this endpoint (the trainer records them); leave it out")
    return ChatRequest(model=str(body.get("model", "")), messages=normalise_messages(body.get("messages")),
                       tools=_tools(body.get("tools")), max_tokens=_max_tokens(body), stop=_stop(body.get("stop")),
                       stream=bool(body.get("stream")),
                       include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
                       seed=_seed(body.get("seed")))


def _tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise refuse("tools", "tools must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                     "\"parameters\": {...}}}")
    return tools


def _max_tokens(body: dict) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise refuse("max_tokens", f"max_tokens={value!r} must be a positive integer")
    return value


def _stop(stop: Any) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise refuse("stop", "stop must be a non-empty string or a list of them")
    return stops


def _seed(seed: Any) -> int | None:
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise refuse("seed", f"seed={seed!r} must be an integer")
    return seed


def _text(content: Any, where: str) -> str | None:
    """A message's content as text: a string, None, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise refuse(where, "content must be a string or a list of text parts (images and audio are not supported)")


def normalise_messages(messages: Any) -> list[dict]:
    """OpenAI messages in the chat template's form: text content, tool-call arguments as objects (they arrive as JSON
    strings), each tool message with the `name` of the call it answers."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise refuse("messages", "messages must be a non-empty list of message objects")
    names: dict[str, str] = {}  # tool call id -> function name
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise refuse(f"messages[{i}].role", f"role {role!r} is not one of {', '.join(ROLES)}")
        message: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"messages[{i}].content")}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]", names)
                                     for j, c in enumerate(m["tool_calls"])]
        if role == "tool":
            message["name"] = m.get("name") or names.get(m.get("tool_call_id"), "")
            if m.get("tool_call_id") is not None:
                message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _call(call: Any, where: str, names: dict[str, str]) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise refuse(where, "a tool call must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                     "\"arguments\": ...}}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise refuse(where, f"the arguments {arguments!r:.200} are not JSON") from None
    if call.get("id") is not None:
        names[call["id"]] = function["name"]
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def same_message(a: dict, b: dict) -> bool:
    """Whether two messages are the same turn: role, text and calls (ids and reasoning fields aside: a continued
    sample keeps its exact ids whatever those say)."""
    return (a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")
            and tool_calls_of(a) == tool_calls_of(b))


# ---- the samples of one episode -----------------------------------------------------------------------------------
@dataclass
class Sample:
    """One training sample: its ids (an Episode's), the conversation it has recorded so far (every message of its last
    call, then the answer), and whether its last turn ended on a stop id (only then is it continued)."""

    episode: Episode
    record: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    continuable: bool = False
    busy: bool = False  # a call on it is in flight

    def extended_by(self, request: ChatRequest) -> bool:
        """Whether `request` continues this sample: same tools, the recorded conversation as its start, more after."""
        n = len(self.record)
        return (self.continuable and not self.busy and self.tools == request.tools and len(request.messages) > n
                and all(same_message(a, b) for a, b in zip(request.messages, self.record)))


@dataclass
class Turn:
    """What one call sampled, in OpenAI's terms."""

    message: dict  # role, content, tool_calls (arguments as JSON strings)
    finish_reason: str  # stop | tool_calls | length
    prompt_tokens: int
    completion_tokens: int


@dataclass
class CaptureSettings(GenerationSettings, AgentSettings):
    """The sections a captured episode reads: sampling and max_completion_length, and max_episode_tokens."""


class CaptureEpisode:
    """One call of the agent function: the calls it makes under its model name become samples. Every call goes to
    `client` on `adapter` (pinned) or on what `latest()` gives. A fault of the inference server or a sync's abort is
    kept in `fault` (the producer raises it once the agent returns) and every later call is refused."""

    def __init__(self, name: str, fmt: ChatFormat, cfg: CaptureSettings, client, *, adapter: str, version: int,
                 seed: int | None, max_model_len: int | None, latest: Latest | None = None):
        self.name, self.fmt, self.cfg, self.client = name, fmt, cfg, client
        self.adapter, self.version, self.seed, self.latest = adapter, version, seed, latest
        self.max_model_len = max_model_len
        self.samples: list[Sample] = []
        self.splits = 0  # calls that started a new sample although the episode had one
        self.calls = 0
        self.fault: BaseException | None = None
        self._lock = threading.Lock()

    # ---- linking ---------------------------------------------------------------------------------------------
    def _claim(self, request: ChatRequest) -> tuple[Sample, bool]:
        """The sample this call extends (the longest recorded conversation it continues), marked busy; or a new one."""
        if request.messages[-1]["role"] == "assistant":
            raise refuse("messages", "the last message is an assistant message: continuing a prefilled assistant turn "
                         "is not supported; end with a user or tool message")
        with self._lock:
            if self.fault is not None:
                raise CaptureRefused(410, f"this episode was lost ({self.fault}); it is sent again from its start",
                                     code="episode_lost")
            found = max((s for s in self.samples if s.extended_by(request)), key=lambda s: len(s.record), default=None)
            if found is None:
                self.splits += bool(self.samples)
                prompt_ids = self.fmt.render(request.messages, request.tools, generation_prompt=True)
                found = Sample(Episode(prompt=request.messages, prompt_ids=prompt_ids, tools={}, schemas=request.tools),
                               tools=request.tools)
                self.samples.append(found)
                fresh = True
            else:
                fresh = False
            found.busy = True
            self.calls += 1
            return found, fresh

    def chat(self, request: ChatRequest) -> Turn:
        """Serve one call: sample on the right sample's exact ids, record the answer, return it."""
        sample, fresh = self._claim(request)
        try:
            return self._sample(sample, request, fresh)
        finally:
            sample.busy = False

    def _sample(self, sample: Sample, request: ChatRequest, fresh: bool) -> Turn:
        e = sample.episode
        if not fresh:
            assistant = sample.record[-1]
            suffix = self.fmt.tool_suffix(assistant, request.messages[len(sample.record):], request.tools)
            if self._left(e, len(suffix)) is not None and self._left(e, len(suffix)) < 1:
                e.finish_reason = "length"  # no room for one more token: the sample ends here, truncated
                sample.continuable = False
                raise refuse("messages", "the conversation has reached the episode's token budget "
                             f"(max_episode_tokens={self.cfg.max_episode_tokens}, the server's max_model_len="
                             f"{self.max_model_len})", code="context_length_exceeded")
            e.append(suffix, None, e.versions[-1] if e.versions else self.version)
            e.messages += request.messages[len(sample.record):]
        room = self._room(e, request.max_tokens)
        if room < 1:
            raise refuse("messages", f"the prompt leaves no room to sample within max_model_len={self.max_model_len}",
                         code="context_length_exceeded")
        context = e.prompt_ids + e.ids
        seed = request.seed if request.seed is not None else (
            None if self.seed is None else (self.seed + 7919 * self.calls) % 2**31)
        policy = contextlib.nullcontext((self.version, self.adapter)) if self.latest is None else self.latest()
        try:
            with policy as (version, adapter):  # the adapter stays loaded until the answer is in
                (c,) = self.client.complete(adapter, context, n=1, max_tokens=room, temperature=self.cfg.temperature,
                                            top_p=self.cfg.top_p, seed=seed,
                                            extra={"stop": request.stop} if request.stop else None)
        except Exception as exc:  # an inference server fault: the producer recovers it once the agent returns
            self._lose(exc)
            raise CaptureRefused(502, f"the inference server failed ({exc}); this episode is sent again",
                                 code="episode_lost") from exc
        if c.finish_reason == "abort":
            self._lose(TurnAborted(f"call {self.calls} of {self.name} was aborted by a sync"))
            raise CaptureRefused(410, "a weight sync aborted this call; the episode is sent again",
                                 code="episode_lost")
        e.append(c.token_ids, c.logprobs, version)
        e.turns += 1
        message = self.fmt.parse(context, c.token_ids, request.tools)
        message = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls", "reasoning_content")}
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": name, "arguments": arguments}} for name, arguments in tool_calls_of(message)]
        if calls:
            message["tool_calls"] = calls
        e.messages.append(message)
        ended = bool(c.token_ids) and c.token_ids[-1] in self.fmt.stop_ids
        cut = c.finish_reason == "length" and not ended
        e.finish_reason = "length" if cut else "stop"
        sample.record = [*request.messages, message]
        sample.continuable = ended  # a stop string or a cut turn has no end-of-turn id to continue after
        finish = "length" if cut else "tool_calls" if calls else "stop"
        return Turn(message=openai_message(message), finish_reason=finish, prompt_tokens=len(context),
                    completion_tokens=len(c.token_ids))

    def _lose(self, exc: BaseException) -> None:
        with self._lock:
            if self.fault is None:
                self.fault = exc

    def _left(self, e: Episode, more: int = 0) -> int | None:
        left = [] if self.cfg.max_episode_tokens is None else [self.cfg.max_episode_tokens - len(e.ids) - more]
        if self.max_model_len is not None:
            left.append(self.max_model_len - len(e.prompt_ids) - len(e.ids) - more)
        return min(left) if left else None

    def _room(self, e: Episode, requested: int | None) -> int:
        room = min(self.cfg.max_completion_length, requested or self.cfg.max_completion_length)
        left = self._left(e)
        return room if left is None else min(room, left)


# ---- answers in OpenAI's shapes -------------------------------------------------------------------------------------
def openai_message(message: dict) -> dict:
    """A parsed assistant message as OpenAI returns one: content None beside calls, arguments as JSON strings."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.dumps(c["function"]["arguments"])}}
                             for c in message["tool_calls"]]
    elif out["content"] is None:
        out["content"] = ""
    return out


def chat_response(model: str, turn: Turn) -> dict:
    """The /v1/chat/completions answer (non-streamed)."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": turn.message, "finish_reason": turn.finish_reason,
                                         "logprobs": None}],
            "usage": usage(turn)}


def usage(turn: Turn) -> dict:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens}


def stream_chunks(model: str, turn: Turn, include_usage: bool) -> list[dict]:
    """`stream: true`: the answer, sampled whole first, as OpenAI's chunks (role and content, each tool call, the
    finish reason, the usage if asked)."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    delta: dict[str, Any] = {"role": "assistant", "content": turn.message.get("content") or ""}
    chunks = [chunk(delta)]
    for i, call in enumerate(turn.message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, turn.finish_reason))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": usage(turn)})
    return chunks

