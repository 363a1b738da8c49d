"""A tool-calling chat format for the toy byte tokenizer, written for the tests (the toy world's own has none).

Every sampled turn that says anything is a call of the one tool `lookup` with the turn's text as its key: the
response template has a single implicit `tool_calls` region that closes at `<|endoftext|>`. So the toy model, which
knows no tool format, still drives a real parse path (`parse_response` with the running ids as prefix), and whether a
turn calls a tool does not depend on what it happens to write. An empty turn (the end of text at once) is a plain
answer. Tool results are `tool` turns; the assistant turn ends at `<|endoftext|>` (id 0, where the model stops).
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.arguments.key }}{% endfor %}<|endoftext|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"tool_calls": {"close": "<|endoftext|>", "content": "text", "repeats": True,
                              "transform": {"type": "function",
                                            "function": {"name": "lookup", "arguments": {"key": "{content}"}}}}},
}


def agent_tokenizer():
    """The toy byte tokenizer with the format above."""
    from asyncgrpo.toy.tokenizer import build_tokenizer  # heavy: transformers

    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def lookup(key: str) -> str:
    """The tool of this format: a short, deterministic answer for any key.

    Args:
        key: what the model wrote
    """
    return f"[{len(key)}]"


def agent_model(world, tmp_path):
    """The toy model with this format's tokenizer saved beside it (vLLM gets ids only, so it serves the toy model as
    it is)."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(world.model_dir, model_dir)
    agent_tokenizer().save_pretrained(model_dir)  # the chat template and the response template go with it
    return model_dir
