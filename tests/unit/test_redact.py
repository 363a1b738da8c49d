"""redact: every run of 8+ characters of a key, or of its base64 / percent-encoded forms, is masked; shorter runs and
other text are left alone."""

import base64
import urllib.parse

import pytest

from asyncgrpo.redact import MASK, MIN_RUN, redact

KEY = "sk-Zq7+Lw9/xR2vT5mN8bK3cJ6hF1dG4sA0"  # 36 characters, with the '+' and '/' that URL encodings change


def test_the_whole_key_and_every_part_of_8_characters_are_masked():
    assert redact(f"bad token Bearer {KEY}.", KEY) == f"bad token Bearer {MASK}."
    assert redact(f'"...Bearer {KEY[:18]}', KEY) == f'"...Bearer {MASK}'  # a quote cut mid-key
    assert redact(f"{KEY[10:18]} and {KEY[-9:]}", KEY) == f"{MASK} and {MASK}"


def test_runs_shorter_than_8_characters_and_other_text_are_kept():
    text = f"prefix {KEY[:7]} suffix"
    assert redact(text, KEY) == text
    assert redact("no key here", KEY) == "no key here"
    assert redact("anything", None) == "anything" and redact("", KEY) == ""


@pytest.mark.parametrize("prefix", ["", "B", "Be", "Authorization: Bearer "])  # each byte alignment in base64
@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode], ids=["base64", "base64url"])
def test_a_base64_echo_of_the_header_is_masked(prefix, encode):
    echoed = encode(f"{prefix}{KEY} and more".encode()).decode()
    scrubbed = redact(echoed, KEY)

    assert scrubbed.count(MASK) == 1
    a = scrubbed.index(MASK)  # echoed[:a] and echoed[b:] are left as they were
    b = len(echoed) - (len(scrubbed) - a - len(MASK))
    first, end = len(prefix), len(prefix) + len(KEY)  # the key's bytes in the encoded text
    assert min(a * 3 // 4, end) - first < MIN_RUN  # key bytes the characters before the mask spell
    assert end - max(-(-b // 4) * 3, first) < MIN_RUN  # and those after it


def test_a_percent_encoded_echo_is_masked():
    for quoted in (urllib.parse.quote(KEY, safe=""), urllib.parse.quote_plus(KEY)):
        assert redact(f"url=/x?token={quoted}&y=1", KEY) == f"url=/x?token={MASK}&y=1"


def test_a_key_shorter_than_8_characters_is_masked_whole():
    assert redact("key abc123 abc12", "abc123") == f"key {MASK} abc12"
