"""IncrementalDetokenizer: UTF-8 safety across token boundaries and stop strings."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.replica.detokenizer import IncrementalDetokenizer
from iterserve.replica.make_model import ASSETS
from iterserve.replica.tokenizer import Tokenizer

TOK = Tokenizer.from_pretrained(Path(ASSETS))  # the committed tokenizer.json alone
PROMPT = TOK.encode("The prompt is ignored:")


def stream(text_or_ids: str | list[int], chunks: list[int] | None = None,
           **kwargs: object) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed ids (one at a time, or in the given chunk sizes); return deltas and the stop."""
    ids = TOK.encode(text_or_ids, add_special_tokens=False) if isinstance(text_or_ids, str) \
        else text_or_ids
    detok = IncrementalDetokenizer(TOK, PROMPT, **kwargs)
    deltas, stop, i = [], None, 0
    sizes = iter(chunks or [])
    while i < len(ids) and stop is None:
        n = next(sizes, 1)
        delta, stop = detok.add(ids[i:i + n])
        deltas.append(delta)
        i += n
    deltas.append(detok.flush())
    return deltas, stop, detok


def expected_cut(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """Text up to the stop string that ends first (ties: the longest)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, s = min(found)
    return (text[:end] if include else text[:start]), s


def test_multibyte_characters_split_across_tokens_are_never_emitted_partially():
    text = "中文 🎉 done"
    ids = TOK.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # the tokenizer really splits characters into byte tokens
    deltas, stop, _ = stream(text)
    assert stop is None and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some steps had to wait for the rest of a character


def test_plain_ascii_streams_token_by_token():
    deltas, _, _ = stream("Return a list")
    assert deltas[:3] == ["Return", " a", " list"]


def test_special_tokens_skipped_or_kept():
    ids = TOK.encode("hi", add_special_tokens=False) + [TOK.token_to_id("<|eot_id|>")]
    assert "".join(stream(ids)[0]) == "hi"
    assert "".join(stream(ids, skip_special_tokens=False)[0]) == "hi<|eot_id|>"


def test_stop_string_across_tokens_is_cut_and_later_text_suppressed():
    deltas, stop, detok = stream("one two STOP three", stop=("STOP",))
    assert stop == "STOP" and "".join(deltas) == "one two "
    assert detok.output_text == "one two " and detok.finished
    assert detok.add(TOK.encode(" more", add_special_tokens=False)) == ("", None)


def test_stop_string_included_when_asked():
    deltas, stop, _ = stream("one two STOP three", stop=("STOP",), include_stop_str_in_output=True)
    assert stop == "STOP" and "".join(deltas) == "one two STOP"


def test_possible_stop_prefix_is_held_back_then_released():
    detok = IncrementalDetokenizer(TOK, PROMPT, stop=("abcd",))
    outputs = [detok.add(TOK.encode(piece, add_special_tokens=False))[0]
               for piece in ("x", "ab", "c", "e")]
    assert outputs[0] == "x" and outputs[1] == "" and outputs[2] == ""
    assert outputs[3] == "abce"
    assert detok.flush() == ""


def test_flush_releases_held_back_text_at_finish():
    detok = IncrementalDetokenizer(TOK, PROMPT, stop=("the end",))
    assert detok.add(TOK.encode("and the", add_special_tokens=False)) == ("and ", None)
    assert detok.flush() == "the"


def test_flush_emits_a_truncated_character_at_finish():
    ids = TOK.encode("中", add_special_tokens=False)[:2]  # two of its three bytes
    deltas, _, _ = stream(ids)
    assert deltas[:-1] == ["", ""] and deltas[-1] == "\ufffd"


def test_stop_ending_first_wins():
    deltas, stop, _ = stream("xabcdy", stop=("abcd", "bc"))
    assert stop == "bc" and "".join(deltas) == "xa"


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(TOK, PROMPT, stop=("",))


ALPHABET = "ab c\n.中é🎉"


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 4), max_size=40),
)
def test_streamed_text_is_the_full_text_cut_at_the_first_stop(text, stops, include, chunks):
    deltas, stop, _ = stream(text, chunks, stop=tuple(stops), include_stop_str_in_output=include)
    expected, expected_stop = expected_cut(text, tuple(stops), include)
    assert "".join(deltas) == expected and stop == expected_stop
    # Mid-stream deltas never carry a replacement character: the text holds none.
    assert all("\ufffd" not in d for d in deltas)
