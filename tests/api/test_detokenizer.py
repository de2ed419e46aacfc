"""Streaming text (lesson_utils/api/detokenizer.py): nothing sent is ever a broken character, everything sent adds up
to the decoded answer, and stop strings are found across token boundaries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lesson_utils.api.detokenizer import REPLACEMENT, IncrementalDetokenizer, StopStrings

MIXED = "Crème brûlée, 東京の天気 and a 🚀 launch: naïve café ✓"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from lesson_utils.model.trained import trained_folder

    return AutoTokenizer.from_pretrained(trained_folder(show=False))


def test_token_by_token_decoding_breaks_characters_and_the_detokenizer_does_not(tokenizer):
    ids = tokenizer.encode(MIXED, add_special_tokens=False)
    alone = [tokenizer.decode([t]) for t in ids]
    assert sum(REPLACEMENT in a for a in alone) >= 5  # the problem is real for this tokenizer
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say it:", add_special_tokens=False))
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    assert not any(REPLACEMENT in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == detok.text
    assert sum(1 for p in pieces if p) < len(ids)  # some tokens waited for the next to complete a character


@settings(max_examples=40, deadline=None)
@given(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=40),
    st.integers(1, 4),
)
def test_whatever_the_text_and_however_the_tokens_arrive_the_pieces_add_up(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any(REPLACEMENT in p for p in pieces[:-1]) or REPLACEMENT in tokenizer.decode(ids)


def test_special_tokens_are_not_text(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Paris.", add_special_tokens=False)
    assert detok.push(ids) + detok.push([end]) + detok.flush() == "Paris."


@pytest.mark.parametrize(
    "pieces, stops, sent, stopped",
    [
        (["Hello wor", "ld. Bye"], ["world"], "Hello ", True),  # across a boundary
        (["a", "b", "c"], ["bd"], "abc", False),  # "b" held until "c" shows it is not "bd"
        (["The end", "."], ["\n\n"], "The end.", False),
        (["x\n", "\ny"], ["\n\n"], "x", True),
        (["stop at once"], ["stop"], "", True),
        (["no stops"], [], "no stops", False),
        (["abAB", "X"], ["ABC", "BX"], "abA", True),  # the earliest hit wins
    ],
)
def test_stop_strings(pieces, stops, sent, stopped):
    s = StopStrings(stops)
    out, hit = "", False
    for p in pieces:
        text, hit = s.feed(p)
        out += text
        if hit:
            break
    out += s.flush()
    assert (out, hit) == (sent, stopped)
    assert s.feed("more") == ("", True) if stopped else True
