"""Incremental detokenisation equals a full decode; stop strings split across tokens are found."""

from __future__ import annotations

import itertools

import pytest

from pagefleet.engine.detokenizer import Detokenizer
from pagefleet.engine.model.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, how does the cache work?",
        "naïve café — déjà vu 🙂 ok",
        "  spaced   out\nlines",
    ],
)
def test_incremental_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("The answer:")
    ids = tokenizer.encode(text)
    detok = Detokenizer(tokenizer, prompt)
    seen = []
    for token in ids:
        detok.add_token(token)
        seen.append(detok.text)
    detok.flush()
    assert detok.text == tokenizer.decode(ids)
    # Text only grows, and never shows half a character.
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))
    assert not any("\ufffd" in t for t in seen)


def test_stop_string_across_token_boundaries_is_cut_and_held_back(tokenizer):
    ids = tokenizer.encode("one two three four five six")
    detok = Detokenizer(tokenizer, [], stop=("four f", "zzz"))
    hit = None
    for token in ids:
        hit = detok.add_token(token)
        # While running, a possible start of a stop string is never streamed.
        assert "four" not in detok.stream_text(finished=False) or hit
        if hit:
            break
    assert hit == "four f"
    assert detok.text == "one two three "


def test_earliest_stop_string_wins(tokenizer):
    detok = Detokenizer(tokenizer, [], stop=("three", "two"))
    for token in tokenizer.encode("one two three"):
        if detok.add_token(token):
            break
    assert detok.text == "one "
