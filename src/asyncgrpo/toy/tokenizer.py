"""A one-token-per-character tokenizer for the toy world, loadable by HF and vLLM like any other.

A byte-level BPE with an empty merge list, so every byte is its own token. Ids: 0 `<|endoftext|>` (eos and pad),
1 `<|im_start|>`, 2 `<|im_end|>`, 3 + b for byte b (so "0" is 51): 259 ids. The model's vocabulary is padded to 320,
and a model that has not learned much can sample the padding ids 259..319: `decode_completion` turns those into a
character that no answer contains.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
"""The special tokens, in id order: `SPECIAL_TOKENS[i]` has id i."""

EOS_ID = 0
BYTE_OFFSET = len(SPECIAL_TOKENS)
"""Byte b has id BYTE_OFFSET + b."""

TOKENIZER_SIZE = BYTE_OFFSET + 256

MODEL_MAX_LENGTH = 256
"""The toy model's max_position_embeddings; recorded on the tokenizer so long inputs warn instead of failing late."""

INVALID_ID_TEXT = "\ufffd"
"""What `decode_completion` writes for an id the tokenizer does not know; no reward function accepts it."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then `<|im_start|>assistant\\n` on request."""


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character map that byte-level BPE vocabularies are written in.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _byte_level_vocab() -> dict[str, int]:
    """Specials at 0..2, then byte b at 3 + b, keyed by the byte-level character of b."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for b, char in _bytes_to_unicode().items():
        vocab[char] = BYTE_OFFSET + b
    return vocab


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the toy tokenizer: one token per byte, ChatML specials, eos = pad = `<|endoftext|>` (id 0), no bos.

    Deterministic and offline; `save_pretrained` writes a `tokenizer.json` that vLLM loads as is.
    """
    vocab = _byte_level_vocab()
    assert set(vocab) - set(SPECIAL_TOKENS) == set(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    # use_regex=False: no word splitting, every byte becomes one token whatever surrounds it.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=MODEL_MAX_LENGTH,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == TOKENIZER_SIZE, len(tokenizer)
    return tokenizer


def decode_completion(tokenizer: PreTrainedTokenizerFast, ids: Iterable[int]) -> str:
    """Decode sampled ids up to (not including) the first eos; never raises on ids the tokenizer lacks.

    Ids outside `[0, len(tokenizer))` (the model's padded vocabulary, 259..319) become `INVALID_ID_TEXT`, so a
    completion that contains one can never match an answer. Other special tokens decode to their text.
    """
    size = len(tokenizer)
    pieces: list[str] = []
    run: list[int] = []  # consecutive valid ids, decoded together so multi-byte characters stay whole
    for token_id in (int(i) for i in ids):
        if token_id == tokenizer.eos_token_id:
            break
        if 0 <= token_id < size:
            run.append(token_id)
            continue
        pieces.append(tokenizer.decode(run))
        pieces.append(INVALID_ID_TEXT)
        run = []
    pieces.append(tokenizer.decode(run))
    return "".join(pieces)
