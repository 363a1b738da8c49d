"""Two real tool-call formats, written for the tests from their documented tokens: a Qwen3/Hermes `<tool_call>`
chat template (tool results in a `user` turn) and a Gemma 4 one (results inside the model turn, which stops at
`<|tool_response>`), each with its transformers response template, on the toy byte tokenizer with the formats'
tokens added as specials (the real vocabularies are not needed to check where ids are cut). Used by
unit/rollout/test_formats.py and by the tiny Gemma 4 model's episode test (integration/test_architectures_episodes.py).
"""

from __future__ import annotations

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                 "<think>", "</think>"]
QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{% if not loop.first or m.content %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"  # trim_blocks: the newline as an expression
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open_pattern": r"\s*<think>\s*", "close_pattern": r"\s*</think>\s*", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}

GEMMA_SPECIALS = ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
                  "<|tool_response>", "<tool_response|>", '<|"|>']
GEMMA_TEMPLATE = (
    "<bos>{% if tools %}<|turn>system\n{% for t in tools %}<|tool>declaration:{{ t.function.name }}"
    '{description:<|"|>{{ t.function.description }}<|"|>}<tool|>{% endfor %}<turn|>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|turn>user\n{{ m.content }}<turn|>\n"
    "{% elif m.role == 'assistant' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|turn>model\n{% endif %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<|tool_call>call:{{ c.function.name }}{{ '{' }}"
    "{% for k, v in c.function.arguments.items() %}{{ k }}:{% if v is string %}<|\"|>{{ v }}<|\"|>{% else %}{{ v }}"
    "{% endif %}{% if not loop.last %},{% endif %}{% endfor %}}<tool_call|>{% endfor %}"
    "{% if m.tool_calls %}<|tool_response>{% else %}<turn|>\n{% endif %}"
    "{% elif m.role == 'tool' %}response:{{ m.name }}{value:<|\"|>{{ m.content }}<|\"|>}<tool_response|>"
    "{% if not loop.last and messages[loop.index0 + 1].role == 'tool' %}<|tool_response>{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt and (not messages or messages[-1].role != 'tool') %}<|turn>model\n{% endif %}"
)
GEMMA_RESPONSE = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["<|turn>model\n", "<tool_response|>"],
    "fields": {
        "tool_calls": {"open_pattern": r"<\|tool_call>call:(?P<name>\w+)", "close": "<tool_call|>", "repeats": True,
                       "content": "json", "content_args": {"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
        "content": {"close": ["<turn|>", "<|tool_response>", "<eos>"], "content": "text"},
    },
}


def tokenizer(specials: list[str], template: str, response: dict):
    """The toy byte tokenizer with a format's tokens added as specials and its chat and response templates."""
    from asyncgrpo.toy.tokenizer import build_tokenizer  # heavy: transformers

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template, tok.response_template = template, response
    return tok


def get_weather(city: str, days: int) -> str:
    """The weather in a city.

    Args:
        city: the city
        days: how many days ahead
    """
    return "sunny" if city == "Paris" else "rain"
