"""The toy agent world's chat format: a compact ChatML with tools, and the `response_template` that parses it back.

Every character is a token and the toy model sees at most 256 positions, so the format is terse:
`<|im_start|>system\\nlookup()<|im_end|>` declares the tools, `@lookup()` is a call (`@name(arg=value)` with
arguments), a tool result is a `tool` turn, and turns are not separated by newlines. An assistant turn ends with
`<|im_end|>` (the tokenizer's eos), so the ids a model samples up to its stop are exactly what the template renders
for its turn.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerFast

from asyncgrpo.toy.tokenizer import EOS_TOKEN, IM_END_TOKEN, build_tokenizer

CHAT_TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\n' }}"
    "{%- for tool in tools -%}{%- set f = tool.function if tool.function is defined else tool -%}"
    "{{ f.name }}({{ f.parameters.properties | list | join(',') }}){{ ' ' if not loop.last }}"
    "{%- endfor -%}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.content is string -%}{{ message.content }}{%- endif -%}"
    "{%- for call in message.tool_calls or [] -%}{%- set f = call.function if call.function is defined else call -%}"
    "@{{ f.name }}("
    "{%- if f.arguments is mapping -%}"
    "{%- for name, value in f.arguments.items() -%}{{ name }}={{ value }}{{ ',' if not loop.last }}{%- endfor -%}"
    "{%- else -%}{{ f.arguments }}{%- endif -%})"
    "{%- endfor -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
"""Tools (name and parameter names) in a system turn, then `<|im_start|>{role}\\n{content}{calls}<|im_end|>` per
message, calls written `@name(arg=value,...)`; `<|im_start|>assistant\\n` on request. A tool message renders its
content only (one tool call per turn is what the toy model learns, so results need no name)."""

RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"@(?P<name>\w+)\(",
            "close": ")",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"(?P<key>\w+)=(?P<value>[^,)]*)"},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|im_end\|>|<\|endoftext\|>", "content": "text"},
    },
}
"""transformers' response_template (version 1) for CHAT_TEMPLATE: `@lookup()<|im_end|>` parses to
`{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]}`
(`@f(key=qx)` to arguments `{"key": "qx"}`); any other text is the `content`. Argument values cannot contain `,`
or `)`."""


def build_agent_tokenizer() -> PreTrainedTokenizerFast:
    """The toy byte-level tokenizer with CHAT_TEMPLATE and RESPONSE_TEMPLATE. Its eos is `<|im_end|>` (id 2), the
    end of an assistant turn, as for Qwen2.5-Instruct; pad stays `<|endoftext|>` (id 0)."""
    tokenizer = build_tokenizer()
    tokenizer.eos_token = IM_END_TOKEN
    tokenizer.pad_token = EOS_TOKEN
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def render_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               add_generation_prompt: bool = False) -> list[int]:
    """The chat template's token ids for `messages` (a plain list, whatever transformers' default return type)."""
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, return_dict=False))


_DUMMY_TURNS = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]}]


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]], tools: list[Any] | None = None) -> list[int]:
    """The ids the template adds after an assistant turn that called tools: the tool messages and the generation
    prompt. Found by rendering a dummy exchange with and without them; raises if the template rewrote the
    dummy's turns (not prefix-preserving), since the next prompt is built on the sampled ids as they are."""
    before = render_ids(tokenizer, _DUMMY_TURNS, tools)
    after = render_ids(tokenizer, [*_DUMMY_TURNS, *tool_messages], tools, add_generation_prompt=True)
    if after[: len(before)] != before:
        raise ValueError("the chat template renders an assistant tool-call turn differently once tool messages "
                         "follow it; a multi-turn episode cannot continue on the sampled ids")
    return after[len(before):]
