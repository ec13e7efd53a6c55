"""Committing tokens to a request (SPEC 5, step 5): its output ends exactly at EOS or a stop token
(included), a stop string (excluded from the text; tokens after the one completing it are
dropped) or max_tokens, and a finished request's KV slot is freed at once.
"""

from __future__ import annotations

import time

from .metrics import request_spec_details, vllm_spec_decode_metrics
from .request_state import RequestState
from .requests import RequestOutput, TokenLogprob


def commit_tokens(r: RequestState, tokens: list[int], eos: set[int],
                  logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
    """Append the committed ``tokens`` to ``r``, up to where its output ends; ``logprobs`` (one
    per token, or None) are trimmed alike. Returns this step's output of the request."""
    p = r.req.params
    room = p.max_tokens - len(r.output)
    keep = tokens[:room]
    reason = "length" if len(tokens) >= room else None
    for i, tok in enumerate(keep):
        if (tok in eos and not p.ignore_eos) or tok in p.stop_token_ids:
            keep, reason = keep[:i + 1], "stop"
            break
    text = ""
    if r.detok is not None:
        res = r.detok.add(keep)
        text = res.text
        if res.stopped:
            keep, reason = keep[:res.num_tokens_kept], "stop"
        elif reason is not None:
            text += r.detok.finish()
    r.output += keep
    r.text += text
    r.finish_reason = reason
    if reason is not None:  # its KV slot serves the next request now, not at collection
        r.kv.release()
    return RequestOutput(r.req.request_id, keep, text, reason is not None, reason,
                         len(r.req.prompt_ids), len(r.output),
                         logprobs=None if logprobs is None else logprobs[:len(keep)])


def with_spec_details(r: RequestState, out: RequestOutput, num_spec_tokens: int) -> RequestOutput:
    """A finished output carries the request's speculation summary when it asked, with the
    engine's own timing of it: ``engine_ttft_s`` (arrival in the engine to its first token, queue
    and prefill included) and ``engine_decode_tokens_per_s`` (tokens after the first over the
    seconds from the first to now, the last; None for a one-token answer). A client compares them
    with what it reads behind HTTP to tell the engine's pace from the serving path's. With
    ``spec_decode_metrics`` it also carries vLLM's per-request ``metrics`` object
    (``num_spec_tokens``: the engine's k)."""
    if out.finished and r.req.spec_decode_metrics != "none":
        out.metrics = {"speculative_decoding": vllm_spec_decode_metrics(
            r.rounds, num_spec_tokens, detailed=r.req.spec_decode_metrics == "detailed")}
    if out.finished and r.req.return_spec_details:
        out.spec_details = request_spec_details(r.rounds)
        now = time.perf_counter()
        first = r.first_token_s if r.first_token_s is not None else now
        decode_s = now - first
        out.spec_details["engine_ttft_s"] = first - r.arrival_s
        out.spec_details["engine_decode_tokens_per_s"] = (
            (len(r.output) - 1) / decode_s if len(r.output) > 1 and decode_s > 0 else None)
    return out
