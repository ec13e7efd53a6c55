"""Generate stage on the project's own engine (``generate.backend: engine``): the regeneration of
``generate.py`` decoded by :class:`serve.engine.core.SpecEngine` in target-only mode, the continuous
batching engine that serving and evaluation run.

What differs from the hf backend is how the answers of one Ray Data batch are decoded: the engine
keeps ``generate.max_num_requests`` sequences in flight, a finished one's KV slot takes the next
prompt at once (no padding, no batch waiting for its longest answer), and every decode row of a
step attends its own KV slot in one call of the decode attention kernel
(``serve/engine/decode_attention.py``). A conversation's next
turn is queued the moment its previous answer ends (no turn waits for the batch's other
conversations), and finished conversations leave the actor in small chunks while the rest of the
batch decodes (:meth:`EngineGenerateUDF.__call__` is a generator), so the stage writes them, and a
stopped run keeps them, within ``FLUSH_S`` seconds of finishing. Rows, conversation walk,
prompts, EOS set, answer cutting (:func:`pipeline.generate.hf.finish_answer`), resume by id and the
error file are the hf backend's (the same :class:`pipeline.generate.hf.GenerateUDF` walk and
:func:`pipeline.generate.hf.run_generate` writer).

Sampling: the engine's (``drafters.sampling.warped_probs``: temperature, top-k, top-p, the hf
backend's warps), each answer from its own generator seeded by (``seed``, row id, turn), so a
row's random draws do not depend on which batch or actor it ran in (the hf backend's do). Its
text is then reproducible exactly in fp32; in bf16 the target's logits vary at rounding level with
the composition of each packed pass, which can change a sampled token.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterator

import numpy as np

from serve.engine.builder import build_engine, load_models
from serve.engine.config import EngineConfig
from serve.engine.errors import RequestError
from serve.engine.requests import EngineRequest, SamplingParams

from .hf import GenerateUDF, answer_length, finish_answer, next_user_turn

FLUSH_S = 60.0  # finished conversations wait at most this long (seconds) before leaving the actor


def answer_seed(seed: int, key: str) -> int:
    """The RNG seed of one answer: the run's ``seed`` and the answer's "<row id>:<turn>" key
    (a 63-bit integer, the engine's seed range)."""
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63


class EngineGenerateUDF(GenerateUDF):
    """Ray Data callable class (backend engine): holds one target-only :class:`SpecEngine`.

    Args (beyond :class:`pipeline.generate.hf.GenerateUDF`'s):
        max_num_requests: sequences decoded together (the engine's batch).
        kv_cache_memory_gib: the engine's KV pool (GiB): ``max_num_requests`` slots of
            ``max_prompt_tokens + sampling.max_new_tokens`` positions must fit.
        attention: the engine's ``attention`` (``serve.engine.config.EngineConfig``).
    Raises:
        ValueError: the KV budget holds too few positions for the longest prompt + answer.
    """

    def __init__(self, target: str, dtype: str, sampling: dict, template_kwargs: dict,
                 num_threads: int | None, max_prompt_tokens: int, seed: int,
                 max_num_requests: int, kv_cache_memory_gib: float, attention: str = "kernel"):
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        self.torch = torch
        models = load_models(target, dtype)
        self.tokenizer, self.eos_ids = models.tokenizer, models.eos
        self.sampling, self.template_kwargs = sampling, template_kwargs
        self.max_prompt_tokens, self.seed = max_prompt_tokens, seed
        self.generated_tokens = 0  # sampled answer tokens so far, end tokens included
        wanted = max_prompt_tokens + sampling["max_new_tokens"]
        self.engine = build_engine(models, EngineConfig(
            scheduler="none", max_num_requests=max_num_requests, max_model_len=wanted,
            kv_cache_memory_gib=kv_cache_memory_gib, max_waiting=1_000_000, attention=attention),
            tokenizer=False)
        if self.engine.max_model_len < wanted:
            raise ValueError(
                f"generate.kv_cache_memory_gib {kv_cache_memory_gib} holds "
                f"{self.engine.max_model_len} positions for each of generate.max_num_requests "
                f"{max_num_requests} sequences; max_prompt_tokens + sampling.max_new_tokens need "
                f"{wanted}: raise the budget or lower max_num_requests")

    def sample_tokens(self, prompts: list[list[int]], keys: list[str]
                      ) -> tuple[list[list[int]], list[str]]:
        """Decode every prompt with continuous batching.

        Args:
            prompts: rendered prompt token ids; keys: "<row id>:<turn>" of each (its seed).
        Returns:
            (sampled tokens of each answer, the end token included when one ended it; per-row
            errors, "" = none: a row the engine refused or failed has its error here and the
            others are unaffected).
        """
        s = self.sampling
        tokens: list[list[int]] = [[] for _ in prompts]
        errors = [""] * len(prompts)
        for i, (prompt, key) in enumerate(zip(prompts, keys)):
            params = SamplingParams(max_tokens=s["max_new_tokens"], temperature=s["temperature"],
                                    top_p=s["top_p"], top_k=s["top_k"],
                                    seed=answer_seed(self.seed, key))
            try:
                self.engine.add_request(EngineRequest(str(i), prompt, params))
            except RequestError as err:
                errors[i] = str(err)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    i = int(out.request_id)
                    tokens[i] += out.new_token_ids
                    if out.finish_reason == "error":
                        errors[i] = str(out.error)
        except BaseException:
            # a failed step (out of memory, say) leaves this call's requests and their KV slots
            # in the engine: free them, so the caller's row-by-row retry starts from empty
            for i in range(len(prompts)):
                self.engine.abort(str(i))
            raise
        return tokens, errors

    def _generate(self, prompts: list[list[int]], keys: list[str]
                  ) -> tuple[list[str], list[str], list[str]]:
        """Answers to ``prompts`` (:meth:`sample_tokens`, cut and decoded as the hf backend does).

        Returns:
            (answer texts, finish reasons "stop" / "length", per-row errors: "" = none).
        """
        tokens, errors = self.sample_tokens(prompts, keys)
        texts, reasons, ends = [], [], set(self.eos_ids)
        for toks in tokens:
            self.generated_tokens += answer_length(toks, ends)
            text, reason = finish_answer(self.tokenizer, toks, ends)
            texts.append(text)
            reasons.append(reason)
        return texts, reasons, errors

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, list]]:
        """Regenerate every conversation of ``batch`` (input and output columns: the class
        docstring of :class:`pipeline.generate.hf.GenerateUDF`), each conversation's turns in order,
        all conversations decoding together.

        Yields:
            the finished conversations (output columns), whenever some finished and ``FLUSH_S``
            seconds have passed since the last yield, and the rest at the end; every input row
            exactly once.
        """
        s = self.sampling
        ids = [str(x) for x in batch["id"]]
        turns = [json.loads(m) for m in batch["messages"]]
        histories: list[list[dict]] = [[] for _ in ids]
        cursors = [0] * len(ids)
        reasons: list[list[str]] = [[] for _ in ids]
        errors = [""] * len(ids)
        in_flight: dict[int, tuple[list[int], str, list[int]]] = {}  # row -> prompt, key, tokens
        finished: list[int] = []

        def advance(i: int) -> None:
            """Queue row ``i``'s next answer, or mark the row finished (done or failed)."""
            while not errors[i]:
                cursors[i], has_turn = next_user_turn(turns[i], histories[i], cursors[i])
                if not has_turn:
                    break
                prompt, errors[i] = self.turn_prompt(histories[i])
                if prompt is None:
                    break
                key = f"{ids[i]}:{len(reasons[i])}"
                params = SamplingParams(max_tokens=s["max_new_tokens"],
                                        temperature=s["temperature"], top_p=s["top_p"],
                                        top_k=s["top_k"], seed=answer_seed(self.seed, key))
                try:
                    self.engine.add_request(EngineRequest(str(i), prompt, params))
                except RequestError as err:
                    errors[i] = f"generation failed: {err}"
                    break
                in_flight[i] = (prompt, key, [])
                return
            finished.append(i)

        def take(i: int, text: str, reason: str, failed: str) -> None:
            errors[i] = self.take_answer(histories[i], reasons[i], text, reason, failed)
            advance(i)

        try:
            for i in range(len(ids)):
                advance(i)
            ends, last_yield = set(self.eos_ids), time.monotonic()
            while in_flight:
                try:
                    outputs = self.engine.step()
                except Exception:
                    # a failed step (out of memory, say): free this batch's requests and KV
                    # slots, then decode each interrupted answer alone (all of them before any
                    # next turn is queued: the one-by-one decode needs the engine to itself), so
                    # one bad row fails alone
                    retry = {i: in_flight.pop(i) for i in list(in_flight)}
                    for i in retry:
                        self.engine.abort(str(i))
                    answers = {i: self.generate_isolated([prompt], [key])
                               for i, (prompt, key, _) in retry.items()}
                    for i, (texts, why, failed) in answers.items():
                        take(i, texts[0], why[0], failed[0])
                    continue
                for out in outputs:
                    i = int(out.request_id)
                    in_flight[i][2].extend(out.new_token_ids)
                    if not out.finished:
                        continue
                    _, _, toks = in_flight.pop(i)
                    if out.finish_reason == "error":
                        take(i, "", "error", str(out.error))
                        continue
                    self.generated_tokens += answer_length(toks, ends)
                    text, reason = finish_answer(self.tokenizer, toks, ends)
                    take(i, text, reason, "")
                if finished and time.monotonic() - last_yield >= FLUSH_S:
                    yield self.output_rows(batch, finished, histories, reasons, errors)
                    finished, last_yield = [], time.monotonic()
        except BaseException:
            # whatever ends this call early (an error, the generator closed) must not leave its
            # requests in the actor's engine for the next batch
            for i in list(in_flight):
                self.engine.abort(str(i))
            raise
        if finished:
            yield self.output_rows(batch, finished, histories, reasons, errors)
