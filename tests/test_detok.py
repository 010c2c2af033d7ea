"""Incremental detokenizer and stop strings, on the tiny model's real byte-level BPE tokenizer."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenizer_server.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "hello world, plain ascii",
    "héllo wörld — naïve café",
    "你好，世界。漢字とかな",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷 end",
    "mixed: a🙂b你c\nnew line\ttab",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True)


def stream(tokenizer, prompt, output, chunks):
    d = IncrementalDetokenizer(tokenizer, prompt)
    deltas, i = [], 0
    for size in chunks:
        deltas.append(d.push(output[i : i + size]))
        i += size
    deltas.append(d.push(output[i:]))
    return deltas, d.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_streams_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    # the tokenizer really splits characters over tokens, or the test proves nothing
    if any(ord(ch) > 127 for ch in text):
        assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    prompt = tokenizer.encode("Say:")
    deltas, tail = stream(tokenizer, prompt, ids, [1] * len(ids))
    assert tail == ""
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_held_back_bytes_come_out_with_the_token_that_completes_them(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1
    d = IncrementalDetokenizer(tokenizer, [])
    assert [d.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "🙂"


def test_flush_returns_an_incomplete_tail_at_the_end(tokenizer):
    ids = tokenizer.encode("ok 🙂")
    d = IncrementalDetokenizer(tokenizer, [])
    shown = "".join(d.push([t]) for t in ids[:-1])
    assert shown == "ok "
    tail = d.flush()
    assert shown + tail == tokenizer.decode(ids[:-1])
    assert tail.endswith(REPLACEMENT_CHAR)


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    skip = IncrementalDetokenizer(tokenizer, [])
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skip.push([t]) for t in ids) == "hi"
    assert "".join(keep.push([t]) for t in ids) == "hi<|im_end|>"


def test_prompt_cut_inside_a_character_does_not_stall_output(tokenizer):
    prompt = tokenizer.encode("x🙂")[:-1]  # ends mid-character
    out = tokenizer.encode(" fine")
    deltas, tail = stream(tokenizer, prompt, out, [1] * len(out))
    assert "".join(deltas) + tail == " fine"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2047), min_size=1, max_size=40),
    st.lists(st.integers(1, 4), max_size=40),
    st.lists(st.integers(0, 2047), max_size=8),
)
def test_any_token_sequence_concatenates_to_the_full_decode(tokenizer, output, chunks, prompt):
    deltas, tail = stream(tokenizer, prompt, output, chunks)
    assert "".join(deltas) + tail == tokenizer.decode(output, skip_special_tokens=True)
    # a delta may carry U+FFFD only where the full decode has one (invalid bytes), never a cut
    if REPLACEMENT_CHAR not in tokenizer.decode(output, skip_special_tokens=True):
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


# ---- stop strings ------------------------------------------------------------------------------


def feed_all(matcher, pieces, match=True):
    shown, stopped = "", False
    for p in pieces:
        text, stopped = matcher.feed(p, match=match)
        shown += text
        if stopped:
            return shown, True
    return shown + matcher.flush(), False


def test_stop_string_across_deltas_is_cut_and_never_shown():
    m = StopStringMatcher(["STOP"])
    shown, stopped = [], False
    for piece in ["abc S", "T", "O", "Pxyz"]:
        text, stopped = m.feed(piece)
        shown.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(shown) == "abc "
    assert shown == ["abc ", "", "", ""]  # the held "S", "ST", "STO" never went out


def test_false_start_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("ART") == ("START", False)
    assert m.flush() == ""


def test_earliest_of_several_stop_strings_wins():
    shown, stopped = feed_all(StopStringMatcher(["world", "lo w", "zzz"]), ["hel", "lo wor", "ld"])
    assert (shown, stopped) == ("hel", True)


def test_no_match_before_min_tokens():
    shown, stopped = feed_all(StopStringMatcher(["b"]), ["abc"], match=False)
    assert (shown, stopped) == ("abc", False)


@settings(max_examples=200, deadline=None)
@given(st.text("abc", max_size=30), st.lists(st.text("abc", min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 2**31))
def test_stop_matcher_equals_cutting_the_text_where_generation_stops(text, stops, seed):
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 4)
        pieces.append(text[i : i + k])
        i += k
    # Generation stops after the first delta whose arrival completes a stop string; the
    # output is cut at the earliest stop string in the text so far. A longer stop string
    # that starts earlier but would only complete later never gets the chance.
    expected, seen = (text, False), ""
    for piece in pieces:
        seen += piece
        cuts = [i for i in (seen.find(s) for s in stops) if i >= 0]
        if cuts:
            expected = (seen[: min(cuts)], True)
            break
    assert feed_all(StopStringMatcher(stops), pieces) == expected


def test_empty_stop_string_is_a_contract_error():
    with pytest.raises(AssertionError):
        StopStringMatcher([""])
