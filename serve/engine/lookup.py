"""Prompt-lookup draft candidates: continue the request's own text where its last n tokens occurred
before (prompt lookup decoding, Saxena 2023; HF transformers ``prompt_lookup_num_tokens``; vLLM's
``ngram`` speculator).

The engine uses these as a second, free draft source next to the drafter
(``serve/engine/draft_planner.py`` decides per request and step which one to verify). A lookup draft
is deterministic, so its draft distribution is one-hot: rejection sampling accepts x with
probability p_t(x) and otherwise samples from p_t with x removed, which keeps decoding exactly
lossless (``serve/engine/rejection.py``).
"""

from __future__ import annotations


class NgramIndex:
    """The most recent earlier start of every n-gram (min_n <= n <= max_n) of a growing token list,
    updated in O(max_n) per appended token; a lookup is O(max_n) too (no scan of the history).

    Args:
        tokens: the initial tokens (the prompt).
        max_n, min_n: the n-gram sizes matched, longest first (1 <= min_n <= max_n).
    Raises:
        ValueError: bad n-gram sizes.
    """

    def __init__(self, tokens: list[int], max_n: int, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n for prompt lookup, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # n-gram -> index of the token that followed its most recent occurrence
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (committed output)."""
        for tok in tokens:
            i = len(self.tokens)  # the index tok lands at: it follows the n-grams ending at i - 1
            for n in range(self.min_n, self.max_n + 1):
                if i >= n:
                    self._next[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(tok)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the
        longest matching suffix n-gram (max_n down to min_n); [] when nothing matches."""
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) <= n:
                continue
            start = self._next.get(tuple(toks[-n:]))
            if start is not None:
                return toks[start:start + num_tokens]
        return []
