"""Incremental detokenization with stop strings for a speculative engine (SPEC section 8).

A speculative step commits a whole accepted block (often several tokens) at once. SPEC section 8
lists what goes wrong in the field when that block is turned into streamed text: text re-emitted,
text split inside a multi-byte character, a stop string inside the accepted block not trimmed,
usage counting tokens that were never emitted. :class:`IncrementalDetokenizer` is built so none of
these can happen.

Scheme (after vLLM's ``detokenize_incrementally`` / ``convert_prompt_ids_to_tokens`` and HF's
``TextStreamer``): the detokenizer keeps every token id but only ever decodes a short *window*
``ids[prefix_offset:]``. ``ids[prefix_offset:read_offset]`` is context whose text was already
emitted (``prefix_text``, cached); the text that ``ids[read_offset:]`` adds is
``decode(window)[len(prefix_text):]``. When the window's text ends in U+FFFD, the last token ended
inside a multi-byte character (a byte-level BPE token can hold one byte of a 4-byte emoji): vLLM
then holds the whole delta back; here only the trailing run of U+FFFD is held back and the text
before it is released at once, so every character is released by exactly the token that holds its
last byte (needed to attribute a stop string to a token, see below). Once the window's text ends on
a complete character, the offsets move up (``prefix_offset = read_offset``,
``read_offset = len(ids)``), so the work per token is O(window), never O(output).

Stop strings (OpenAI ``stop``; vLLM's ``StopChecker``): released text passes through a hold-back
buffer. Text that could be the beginning of a stop string (the longest suffix of the buffer that is
a proper prefix of some stop string, so at most ``max(len(stop)) - 1`` characters) is held until
the next characters decide it; everything before it is emitted. A stop string may span tokens and
``add()`` calls. When one completes, the output is cut before it; the token that released its last
character is the last kept token, later tokens of the same block are dropped and do not count as
usage. ``min_tokens`` applies to stop strings as to EOS and stop tokens (vLLM's detokenizer): a
stop string can only end the output on text released by output token number min_tokens + 1 or
later; an occurrence that completes earlier is plain output (one that starts earlier and completes
later still stops it).

The central property (tested in ``tests/unit/test_detokenize.py``): the concatenation of every
``add().text`` and ``finish()`` equals ``tokenizer.decode(kept_tokens, skip_special_tokens=...)``
cut before the first stop string occurrence, however the tokens are grouped into ``add()`` calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded as context for the first
# generated ones (SentencePiece-style decoders render a token differently at the start of a text).
INITIAL_CONTEXT_TOKENS = 5

# A window whose text has not ended on a complete character for this many tokens is moved on
# anyway (its text, U+FFFD included, emitted). Valid UTF-8 would need 32 tokens in a row that each
# end inside a character (a character has at most 4 bytes); the cap bounds the work for a model
# that emits invalid bytes, or a long run of tokens that decode to nothing (skipped specials).
MAX_PENDING_TOKENS = 32


@dataclass(frozen=True)
class DetokenizeResult:
    """What one :meth:`IncrementalDetokenizer.add` call produced.

    text: new text that is safe to emit now (never a partial character, never text emitted
        before, never any part of a matched stop string).
    stopped: a stop string completed during this call; no further ``add()`` is allowed.
    num_tokens_kept: how many of the given tokens belong to the output: all of them, or, when a
        stop string completed, those up to and including the token that released its last
        character. Usage must count only these.
    matched_stop: the stop string that matched, else None.
    """

    text: str
    stopped: bool
    num_tokens_kept: int
    matched_stop: str | None


class IncrementalDetokenizer:
    """Turns committed token ids into streamed text, one request at a time.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...,
            clean_up_tokenization_spaces=...)``); the byte-level BPE fast tokenizers this project
            serves are the tested case.
        prompt_ids: the rendered prompt; its last few tokens are decode context only (their text is
            never emitted and stop strings are only searched in generated text).
        stop: stop strings (non-empty); the output ends before the first one to complete.
        skip_special_tokens: passed to ``decode`` (the property above holds for either value).
        min_tokens: a stop string completing in the text of the first ``min_tokens`` generated
            tokens does not end the output (it is output text).

    Semantics:
        * ``add(token_ids)`` commits tokens (any number, in order) and returns the text safe to emit
          now (see :class:`DetokenizeResult`).
        * "First" stop string = the occurrence that completes first in the text (smallest end),
          ties going to the one that starts first (the longer). This is the only causal choice:
          streamed character by character the engine must stop as soon as any stop string is
          complete, so with stops ``("abcd", "c")`` the text ``"abcd"`` stops at ``"c"`` with
          output ``"ab"``, whether it arrives in one token or four.
        * ``finish()`` ends the stream when generation ended for another reason (EOS, stop token,
          max_tokens): it returns the held-back text (a possible stop-string prefix that never
          completed). If generation ended in the middle of a multi-byte character, the incomplete
          bytes are emitted as U+FFFD, exactly as ``tokenizer.decode`` of the whole output renders
          them, so the streamed text always equals the non-streamed one. Mid-stream, U+FFFD is only
          emitted for bytes that are definitely invalid (a later token proved they cannot
          complete), never for a character still in progress.
        * ``clean_up_tokenization_spaces`` is always off (vLLM does the same): the clean-up rewrites
          text across token boundaries and cannot be streamed.

    Raises:
        ValueError: an empty stop string.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(dict.fromkeys(stop))  # de-duplicated, order kept
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = [int(t) for t in prompt_ids]
        self._num_prompt = len(self._ids)
        self._min_tokens = min_tokens
        # Decode window: ids[prefix_offset:read_offset] is emitted context (text = prefix_text);
        # partial = characters after prefix_text already released while the window's text still
        # ended in an incomplete character.
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_CONTEXT_TOKENS, 0)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self._partial = 0
        self._held = ""  # released text held back as a possible stop-string beginning
        self._stopped = False
        self._finished = False
        self._matched_stop: str | None = None

    # ---------------------------------------------------------------- public

    @property
    def stopped(self) -> bool:
        """A stop string completed (the output is final)."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._matched_stop

    @property
    def output_token_ids(self) -> list[int]:
        """The kept generated tokens (prompt excluded, tokens after a stop string excluded)."""
        return self._ids[self._num_prompt:]

    def add(self, token_ids: list[int]) -> DetokenizeResult:
        """Commit ``token_ids`` (one step's accepted block, in order) and return the new text.

        Tokens are processed one at a time (O(window) each), so a stop string that completes
        inside the block is attributed to the right token and the rest of the block is dropped.

        Raises:
            RuntimeError: called after a stop string matched or after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("add() after finish()")
        if self._stopped:
            raise RuntimeError(f"add() after stop string {self._matched_stop!r} ended the output")
        pieces: list[str] = []
        kept = 0
        for token_id in token_ids:
            self._ids.append(int(token_id))
            kept += 1
            text, matched = self._filter_stop(self._step(final=False), self._may_stop())
            pieces.append(text)
            if matched is not None:
                break
        return DetokenizeResult("".join(pieces), self._stopped, kept, self._matched_stop)

    def finish(self) -> str:
        """Flush at the end of generation: held-back text, plus the incomplete trailing character
        (as U+FFFD, like ``tokenizer.decode``) if generation ended inside one. Returns "" after a
        stop string matched; idempotent (a second call returns "")."""
        if self._finished:
            return ""
        self._finished = True
        if self._stopped:
            return ""
        text, matched = self._filter_stop(self._step(final=True), self._may_stop())
        if matched is None:
            text, self._held = text + self._held, ""
        return text

    # ---------------------------------------------------------------- internals

    def _may_stop(self) -> bool:
        """The newest token's text may complete a stop string (it is past ``min_tokens``)."""
        return len(self._ids) - self._num_prompt > self._min_tokens

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def _step(self, final: bool) -> str:
        """Text released by the newest token (or, with ``final``, everything still pending)."""
        full = self._decode(self._ids[self._prefix_offset:])
        base = len(self._prefix_text) + self._partial
        pending = len(self._ids) - self._read_offset
        incomplete = full.endswith(REPLACEMENT_CHAR)
        if incomplete and not final and pending < MAX_PENDING_TOKENS:
            # The last token ended inside a character: release what precedes the trailing
            # replacement run (UTF-8 is self-synchronising, so that part is final), keep the run.
            safe = full.rstrip(REPLACEMENT_CHAR)
            delta = safe[base:]
            self._partial += len(delta)
            return delta
        delta = full[base:]
        if len(full) > len(self._prefix_text) or pending >= MAX_PENDING_TOKENS or final:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self._partial = 0
        return delta

    def _filter_stop(self, delta: str, may_stop: bool = True) -> tuple[str, str | None]:
        """Pass released text through the stop-string hold-back buffer.

        ``may_stop`` False (before min_tokens): no stop string may complete in ``delta``, but its
        tail is still held back, since a stop string may start there and complete later.
        Returns (text to emit, matched stop string or None); on a match sets the stopped state.
        """
        if not self._stop:
            return delta, None
        if not delta:
            return "", None
        held = self._held
        buf = held + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stop if may_stop else ():
            # The buffer held no complete stop string, so a new match must end inside delta.
            i = buf.find(s, max(0, len(held) - len(s) + 1))
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            self._stopped = True
            self._matched_stop = best[2]
            self._held = ""
            return buf[:best[1]], best[2]
        keep = 0
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stop):
                keep = k
                break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None


# ------------------------------------------------------------------------ one token's raw bytes
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character a byte-level BPE vocabulary
    writes for each byte -> that byte. Printable Latin-1 bytes stand for themselves; the others
    (control bytes, space, 0x7F-0xA0, 0xAD) take the characters from U+0100 on, in byte order.
    Spelled out here because transformers moved its copy between releases."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_OF_CHAR = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "\u2581"  # SentencePiece's word-boundary mark, a space in the text


def token_bytes(tokenizer) -> Callable[[int], bytes]:
    """A function from token id to the token's raw bytes (OpenAI logprobs ``bytes``).

    A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM2) may hold part of a multi-byte
    character; decoded alone it is U+FFFD, whose bytes say nothing. Its raw bytes come from its
    vocabulary string through the byte-level alphabet instead, so the bytes of consecutive tokens
    concatenate to the UTF-8 of their text. SentencePiece byte-fallback tokens (``<0xE6>``) are
    that byte and ``\u2581`` is a space. Added tokens (specials) and tokenizers of another kind
    give the UTF-8 of the token decoded alone. The kind is read from the fast tokenizer's decoder
    once, here.
    """
    def decoded(token_id: int) -> bytes:
        return tokenizer.decode([token_id]).encode("utf-8")

    try:
        state = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a slow tokenizer, or no decoder: decoded text
        return decoded
    kinds = {state.get("type")} | {d.get("type") for d in state.get("decoders", ())}
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))

    def raw(token_id: int) -> bytes:
        piece = None if token_id in added else tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return decoded(token_id)
        if "ByteLevel" in kinds and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if "ByteFallback" in kinds and (m := _BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if kinds & {"Metaspace", "ByteFallback"}:
            return piece.replace(_METASPACE, " ").encode("utf-8")
        return decoded(token_id)

    return raw
