"""IncrementalDetokenizer (SPEC section 8) on the real SmolLM2 byte-level BPE tokenizer.

Central property: however the tokens are grouped into add() calls, the concatenation of all emitted
text equals ``tokenizer.decode(kept tokens)`` cut before the first stop string, no mid-stream
emission contains U+FFFD for valid UTF-8, every streamed prefix is a prefix of the final text (so
nothing is ever repeated or retracted), and usage counts exactly the tokens up to the one that
completes the stop string.
"""

from __future__ import annotations

import random

import pytest

from serve.engine.detokenize import (MAX_PENDING_TOKENS, DetokenizeResult, IncrementalDetokenizer,
                              token_bytes)

FFFD = "\ufffd"

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog.\nabcabcd, hello world! 42 + 17 = 59",
    "emoji": "Great job 😀👍🏽! Flags 🇫🇷🇯🇵 and family 👨‍👩‍👧 😀😀😀 done ✅",
    "cjk": "日本語のテキスト、中文文本和한국어 텍스트。東京は晴れ。",
    "accented": "Ça va? naïve café, façade, Ålborg, Øre, ß, élève — “quoted” … ñandú",
    "mixed": "def f(x):\n    return x**2  # квадрат 😀\n\tπ ≈ 3.14159, ∑ → ∞ 🚀 fin",
}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _char_ids(tok, text):
    """One token per character (ASCII letters are single tokens): fine-grained boundaries."""
    out = []
    for c in text:
        out += _ids(tok, c)
    return out


def _first_stop(text, stops, after=0):
    """(start, end, stop) of the occurrence that completes first, past character ``after``;
    ties -> the earlier start."""
    best = None
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return None if best is None else (best[1], best[0], best[2])


def _reference(tok, gen, stops, skip=True, min_tokens=0):
    """(expected text, expected kept tokens, matched stop) computed from full decodes only; a stop
    string must complete in text released after the first ``min_tokens`` tokens (vLLM)."""
    full = tok.decode(gen, skip_special_tokens=skip)
    released = tok.decode(gen[:min_tokens], skip_special_tokens=skip).rstrip(FFFD)
    hit = _first_stop(full, stops, len(released) if min_tokens else 0)
    if hit is None:
        return full, len(gen), None
    start, end, s = hit
    for k in range(1, len(gen) + 1):  # first prefix whose decode has the stop's last char final
        if tok.decode(gen[:k], skip_special_tokens=skip)[:end] == full[:end]:
            return full[:start], k, s
    raise AssertionError("unreachable")


def _chunks(seq, rng, max_chunk):
    i, out = 0, []
    while i < len(seq):
        n = rng.randint(1, max_chunk)
        out.append(seq[i:i + n])
        i += n
    return out


def _stream(tok, prompt, chunks, stops=(), skip=True, valid_utf8=True, min_tokens=0):
    """Feed chunks; check streaming invariants; return (text, total kept, stopped, matched)."""
    det = IncrementalDetokenizer(tok, prompt, stop=stops, skip_special_tokens=skip,
                                 min_tokens=min_tokens)
    pieces, kept, res = [], 0, None
    for chunk in chunks:
        res = det.add(chunk)
        assert isinstance(res, DetokenizeResult)
        assert 0 <= res.num_tokens_kept <= len(chunk)
        if valid_utf8:
            assert FFFD not in res.text, (res.text, chunk)
        pieces.append(res.text)
        kept += res.num_tokens_kept
        if res.stopped:
            assert res.matched_stop in stops
            break
        assert res.num_tokens_kept == len(chunk)
    pieces.append(det.finish())
    assert det.finish() == ""
    assert len(det.output_token_ids) == kept
    return pieces, kept, det.stopped, det.matched_stop


def _check(tok, prompt, gen, chunks, stops=(), skip=True, valid_utf8=True, min_tokens=0):
    pieces, kept, stopped, matched = _stream(tok, prompt, chunks, stops, skip, valid_utf8,
                                             min_tokens)
    text, exp_kept, exp_stop = _reference(tok, gen, stops, skip, min_tokens)
    got = "".join(pieces)
    assert got == text
    assert kept == exp_kept
    assert stopped == (exp_stop is not None) and matched == exp_stop
    # No repeats / retractions: every streamed prefix is a prefix of the final text.
    acc = ""
    for p in pieces:
        acc += p
        assert text.startswith(acc)
    return pieces


# ------------------------------------------------------------------ no stop strings


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_one_token_at_a_time_equals_full_decode(tok, prompt, name):
    gen = _ids(tok, TEXTS[name])
    _check(tok, prompt, gen, [[t] for t in gen])


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_random_chunkings_equal_full_decode(tok, prompt, name):
    gen = _ids(tok, TEXTS[name])
    rng = random.Random(1234)
    for _ in range(25):
        _check(tok, prompt, gen, _chunks(gen, rng, rng.choice([2, 4, 8, 16])))
    _check(tok, prompt, gen, [gen])  # everything in one step


def test_multibyte_split_across_tokens_is_held_then_released_whole(tok, prompt):
    gen = _ids(tok, "a😀b")
    assert len(gen) >= 4  # the emoji spans several byte-level tokens
    det = IncrementalDetokenizer(tok, prompt)
    texts = [det.add([t]).text for t in gen]
    assert texts[0] == "a"
    assert all(t == "" for t in texts[1:-2])  # incomplete emoji: nothing emitted
    assert "".join(texts) + det.finish() == "a😀b"
    assert "😀" in texts[-2] or "😀" in texts[-1]


def test_ascii_streams_immediately(tok, prompt):
    gen = _ids(tok, TEXTS["ascii"])
    det = IncrementalDetokenizer(tok, prompt)
    for t in gen:
        assert det.add([t]).text == tok.decode([t])
    assert det.finish() == ""


def test_special_tokens_skipped_or_kept(tok, prompt):
    gen = _ids(tok, "Hi 😀") + [tok.eos_token_id]
    _check(tok, prompt, gen, [[t] for t in gen], skip=True)
    pieces = _check(tok, prompt, gen, [[t] for t in gen], skip=False)
    assert "".join(pieces).endswith("<|im_end|>")


def test_generation_ending_mid_character_flushes_replacement_at_finish(tok, prompt):
    gen = _ids(tok, "ok 😀")[:-1]  # cut inside the emoji (max_tokens hit mid-character)
    assert tok.decode(gen).endswith(FFFD)
    det = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(det.add([t]).text for t in gen)
    assert FFFD not in streamed and streamed == "ok "  # the space rides on the emoji token
    assert streamed + det.finish() == tok.decode(gen)  # same as a non-streamed decode


def test_invalid_bytes_mid_stream_match_full_decode(tok, prompt):
    # A lone continuation byte can never complete: once a later token proves it, it streams as
    # U+FFFD exactly where decode() puts it.
    lone = tok.convert_tokens_to_ids("Ģ")  # byte 0x80
    gen = _ids(tok, "ab") + [lone] + _ids(tok, "cd") + [lone, lone] + _ids(tok, " 😀")
    rng = random.Random(7)
    for _ in range(10):
        _check(tok, prompt, gen, _chunks(gen, rng, 4), valid_utf8=False)


def test_work_per_token_is_bounded_by_the_window(tok, prompt):
    """O(window): no decode call ever sees more than a few tokens, however long the output."""
    class Counting:
        def __init__(self, inner):
            self.inner, self.max_len, self.calls = inner, 0, 0

        def decode(self, ids, **kw):
            self.calls += 1
            self.max_len = max(self.max_len, len(ids))
            return self.inner.decode(ids, **kw)

    gen = _ids(tok, (TEXTS["mixed"] + TEXTS["emoji"]) * 20)
    counting = Counting(tok)
    det = IncrementalDetokenizer(counting, prompt, stop=("never appears here",))
    text = "".join(det.add(c).text for c in _chunks(gen, random.Random(0), 8)) + det.finish()
    assert text == tok.decode(gen)
    assert len(gen) > 1000
    assert counting.max_len <= 12
    assert counting.calls <= 2 * len(gen) + 2
    # Even a stream of invalid bytes keeps the window bounded.
    lead = tok.convert_tokens_to_ids("ð")  # byte 0xF0, a 4-byte lead that never completes
    assert tok.decode([lead]) == FFFD
    counting = Counting(tok)
    det = IncrementalDetokenizer(counting, prompt)
    for _ in range(200):
        det.add([lead])
    det.finish()
    assert counting.max_len <= 2 * MAX_PENDING_TOKENS + 1


# ------------------------------------------------------------------ stop strings


def test_stop_inside_one_token(tok, prompt):
    gen = _ids(tok, " hello world")
    assert len(gen) == 2
    res = IncrementalDetokenizer(tok, prompt, stop=("ll",)).add(gen)
    assert res == DetokenizeResult(" he", True, 1, "ll")


def test_stop_spanning_tokens_in_one_block(tok, prompt):
    gen = _ids(tok, " hello world again")
    res = IncrementalDetokenizer(tok, prompt, stop=("lo wo",)).add(gen)
    assert res == DetokenizeResult(" hel", True, 2, "lo wo")  # " again" dropped


def test_stop_spanning_add_calls(tok, prompt):
    gen = _ids(tok, " hello world again")
    det = IncrementalDetokenizer(tok, prompt, stop=("lo wo",))
    first = det.add(gen[:1])
    assert first == DetokenizeResult(" hel", False, 1, None)  # "lo" held back
    second = det.add(gen[1:])
    assert second == DetokenizeResult("", True, 1, "lo wo")
    assert det.finish() == ""
    with pytest.raises(RuntimeError):
        det.add(gen[2:])


def test_held_back_text_flushed_at_finish(tok, prompt):
    gen = _ids(tok, " hello wor")
    det = IncrementalDetokenizer(tok, prompt, stop=("world",))
    res = det.add(gen)
    assert res.text == " hello " and not res.stopped and res.num_tokens_kept == len(gen)
    assert det.finish() == "wor"  # EOS / max_tokens: the prefix never completed


def test_prefix_overlap_stop(tok, prompt):
    gen = _char_ids(tok, "xabcabcdy")
    assert len(gen) == 9
    det = IncrementalDetokenizer(tok, prompt, stop=("abcd",))
    out = [det.add([t]) for t in gen[:8]]
    assert [r.text for r in out] == ["x", "", "", "", "abc", "", "", ""]
    assert out[-1].stopped and out[-1].num_tokens_kept == 1 and out[-1].matched_stop == "abcd"
    rng = random.Random(3)
    for _ in range(20):
        _check(tok, prompt, gen, _chunks(gen, rng, 4), stops=("abcd",))


def test_multiple_stops_earliest_completion_wins(tok, prompt):
    gen = _char_ids(tok, "xabcdy")
    # "c" completes before "abcd" (which starts earlier): causal choice, independent of chunking.
    for chunks in ([gen], [[t] for t in gen], [gen[:3], gen[3:]]):
        pieces, kept, _, matched = _stream(tok, prompt, chunks, stops=("abcd", "c"))
        assert "".join(pieces) == "xab" and kept == 4 and matched == "c"
    # Same end: the one starting first wins.
    res = IncrementalDetokenizer(tok, prompt, stop=("bc", "abc")).add(gen)
    assert res == DetokenizeResult("x", True, 4, "abc")
    # Both complete inside one token: the same rule ("ell" ends before "hello" does).
    res = IncrementalDetokenizer(tok, prompt, stop=("hello", "ell")).add(_ids(tok, " hello"))
    assert res == DetokenizeResult(" h", True, 1, "ell")
    gen2 = _ids(tok, " hello world")
    res = IncrementalDetokenizer(tok, prompt, stop=("world", "lo w")).add(gen2)
    assert res.text == " hel" and res.matched_stop == "lo w" and res.num_tokens_kept == 2


def test_stop_ending_inside_a_multibyte_character(tok, prompt):
    gen = _ids(tok, "x日本語")
    text = "x日"
    k = next(k for k in range(1, len(gen) + 1) if tok.decode(gen[:k]).startswith(text))
    assert k >= 3  # 日 is split over byte-level tokens
    det = IncrementalDetokenizer(tok, prompt, stop=("日",))
    res = det.add(gen)
    assert res == DetokenizeResult("x", True, k, "日")
    pieces, kept, _, _ = _stream(tok, prompt, [[t] for t in gen], stops=("本",))
    assert "".join(pieces) == "x日" and tok.decode(gen[:kept]) == "x日本"


def test_stop_never_matches_across_prompt_boundary(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt, stop=("assistant\nHi",), skip_special_tokens=False)
    res = det.add(_ids(tok, "Hi there"))
    assert not res.stopped
    assert res.text + det.finish() == "Hi there"


def test_stop_on_special_token_text(tok, prompt):
    gen = _ids(tok, "done") + [tok.eos_token_id] + _ids(tok, " junk")
    res = IncrementalDetokenizer(tok, prompt, stop=("<|im_end|>",),
                                 skip_special_tokens=False).add(gen)
    assert res == DetokenizeResult("done", True, len(_ids(tok, "done")) + 1, "<|im_end|>")


def test_hold_back_is_minimal(tok, prompt):
    """Only the longest suffix that could start a stop string is held (< max(len(stop)) chars)."""
    text = "abxabcabcxab"
    gen = _char_ids(tok, text)
    stops = ("abcd", "xyz")
    det = IncrementalDetokenizer(tok, prompt, stop=stops)
    emitted = ""
    for i, t in enumerate(gen):
        emitted += det.add([t]).text
        seen = text[:i + 1]
        hold = max(k for k in range(min(4, len(seen) + 1))
                   if k == 0 or any(s.startswith(seen[-k:]) for s in stops))
        assert emitted == seen[:len(seen) - hold]
    assert emitted + det.finish() == text


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_random_stops_and_chunkings_property(tok, prompt, name):
    text = TEXTS[name]
    gen = _ids(tok, text)
    rng = random.Random(sorted(TEXTS).index(name))
    for trial in range(12):
        stops = []
        for _ in range(rng.randint(1, 3)):  # substrings of the text, so they do occur
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)])
        if trial % 4 == 0:
            stops = ["not in here", "zzz"]
        stops = tuple(s for s in stops if s.strip(FFFD))
        for max_chunk in (1, 3, 8):
            _check(tok, prompt, gen, _chunks(gen, rng, max_chunk), stops=stops)


# ------------------------------------------------------------------ min_tokens


def test_min_tokens_stop_strings_within_them_are_output_text(tok, prompt):
    """vLLM applies min_tokens to stop strings too (issue 24: ``"min_tokens": 20, "stop": [" "]``
    ended after the first token): an occurrence completing in the first min_tokens tokens' text is
    output; one completing later stops, also when it started within them."""
    gen = _ids(tok, " one two three four five")
    assert len(gen) == 5
    det = IncrementalDetokenizer(tok, prompt, stop=(" ",), min_tokens=3)
    out = [det.add([t]) for t in gen[:4]]
    assert [r.text for r in out] == [" one", " two", " three", ""]
    assert out[3] == DetokenizeResult("", True, 1, " ")
    res = IncrementalDetokenizer(tok, prompt, stop=(" ",), min_tokens=3).add(gen)
    assert res == DetokenizeResult(" one two three", True, 4, " ")
    # "o t" starts in token 2 (" two", within min_tokens=2) and completes in token 3: it stops
    res = IncrementalDetokenizer(tok, prompt, stop=("o t",), min_tokens=2).add(gen)
    assert res == DetokenizeResult(" one tw", True, 3, "o t")
    # ... but not when it completes within them: then the output runs on (held back, then out)
    det = IncrementalDetokenizer(tok, prompt, stop=("o t", "zzzz"), min_tokens=3)
    res = det.add(gen)
    assert not res.stopped and res.text + det.finish() == " one two three four five"
    # max_tokens == min_tokens: generation ends with the stop string never allowed to match
    det = IncrementalDetokenizer(tok, prompt, stop=("four",), min_tokens=4)
    res = det.add(gen[:4])
    assert not res.stopped and res.text + det.finish() == " one two three four"


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_random_stops_chunkings_and_min_tokens_property(tok, prompt, name):
    text = TEXTS[name]
    gen = _ids(tok, text)
    rng = random.Random(100 + sorted(TEXTS).index(name))
    for _ in range(12):
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)])
        stops = tuple(s for s in stops if s.strip(FFFD))
        min_tokens = rng.randrange(len(gen) + 1)
        for max_chunk in (1, 3, 8):
            _check(tok, prompt, gen, _chunks(gen, rng, max_chunk), stops=stops,
                   min_tokens=min_tokens)


# ------------------------------------------------------------------ raw token bytes


def test_byte_level_token_bytes_concatenate_to_the_texts_utf8(tok):
    """OpenAI logprobs ``bytes``: a token inside a multi-byte character decodes alone to U+FFFD,
    but its raw bytes are its own, so consecutive tokens' bytes concatenate to the text's UTF-8."""
    raw = token_bytes(tok)
    for text in [*TEXTS.values(), "".join(map(chr, range(32, 256))), "\x00\t\r\n\x7f\xad"]:
        ids = _ids(tok, text)
        assert tok.decode(ids) == text  # (SmolLM2's vocabulary lacks some control bytes)
        assert b"".join(raw(t) for t in ids) == text.encode("utf-8"), text
    pieces = _ids(tok, "日")
    assert len(pieces) > 1 and all(tok.decode([t]) == FFFD for t in pieces)
    assert [raw(t) for t in pieces] != [FFFD.encode()] * len(pieces)
    assert raw(tok.eos_token_id) == b"<|im_end|>"  # an added token: its text
    try:  # the byte-level alphabet equals transformers' own copy, where this version has one
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:
        return
    from serve.engine.detokenize import _BYTE_OF_CHAR

    assert _BYTE_OF_CHAR == {c: b for b, c in bytes_to_unicode().items()}


def test_sentencepiece_byte_fallback_token_bytes():
    """A Llama-2-style tokenizer: ``<0xE6>`` tokens are that byte, U+2581 a space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<0xE6>": 1, "<0x97>": 2, "<0xA5>": 3, "\u2581hi": 4, "\u2581é": 5}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    sp = PreTrainedTokenizerFast(tokenizer_object=backend)
    raw = token_bytes(sp)
    assert [raw(t) for t in (4, 1, 2, 3, 5)] == [b" hi", b"\xe6", b"\x97", b"\xa5", " é".encode()]
    assert sp.decode([4, 1, 2, 3]) == "hi日"


def test_empty_add_and_validation(tok, prompt):
    det = IncrementalDetokenizer(tok, prompt, stop=("x",))
    assert det.add([]) == DetokenizeResult("", False, 0, None)
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, prompt, stop=("",))
    det.finish()
    with pytest.raises(RuntimeError):
        det.add([1])
