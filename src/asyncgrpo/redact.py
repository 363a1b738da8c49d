"""Scrub a secret (an API key) out of text a server sent back, before the text is cut, logged or raised.

A server, or a proxy in front of it, may quote the request, its `Authorization: Bearer KEY` header included, in an
error page: whole, cut short by its own limit, base64- or percent-encoded. `redact(text, key)` replaces every run of
8 or more characters of the key, or of its common encodings, with `***`.
"""

from __future__ import annotations

import base64
import urllib.parse

MIN_RUN = 8  # shorter runs of a random key also occur by chance in ordinary text; longer ones give a guess a head start
MASK = "***"


def encoded_forms(secret: str) -> set[str]:
    """The strings in which any text that carries `secret` shows its characters: the secret itself, percent-encoded,
    and the inner part of its base64 (standard and URL-safe) at each of the three byte alignments it can have in the
    encoded text (the first and last 4 characters of each also depend on the neighbouring bytes: left out)."""
    forms = {secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret)}
    raw = secret.encode()
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw).decode()
        inner = encoded[4 if shift else 0:-4]
        forms |= {inner, inner.replace("+", "-").replace("/", "_")}
    return {form for form in forms if form}


def redact(text: str, secret: str | None) -> str:
    """`text` with every run of MIN_RUN or more characters of `secret`, or of one of its encoded forms, replaced by
    MASK (a secret shorter than MIN_RUN: each whole occurrence). A falsy secret leaves the text as it is."""
    if not secret or not text:
        return text
    spans = []  # (start, end) of every occurrence of every MIN_RUN-character window of every form
    for form in encoded_forms(secret):
        run = min(MIN_RUN, len(form))
        for start in range(len(form) - run + 1):
            window = form[start:start + run]
            at = text.find(window)
            while at != -1:
                spans.append((at, at + run))
                at = text.find(window, at + 1)
    if not spans:
        return text
    out, done = [], 0  # done: text[:done] is handled
    for start, end in sorted(spans):
        if start > done:
            out += [text[done:start], MASK]
        elif not out:
            out.append(MASK)  # a run at the very start
        done = max(done, end)
    out.append(text[done:])
    return "".join(out)
