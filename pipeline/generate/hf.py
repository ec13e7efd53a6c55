"""Generate stage: the target regenerates every assistant turn (SPEC 1.2) in a Ray Data actor pool.

User turns are replayed in order and each reply is conditioned on the regenerated ones. Results are
appended to ``<split>.jsonl`` keyed by prompt id as the actors hand them over (the hf backend per
finished batch, the engine backend every minute or so); failures go to ``errors.jsonl``; a re-run
skips ids already present in either file (no duplicates, no gaps).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from drafters.sampling import sample_rows
from serve.engine.chat import render_prompt_ids
from serve.engine.target_loading import eos_token_ids, load_target, load_tokenizer

if TYPE_CHECKING:
    from ..config import GenerateConfig

logger = logging.getLogger(__name__)


def next_user_turn(conv: list[dict], history: list[dict], cursor: int) -> tuple[int, bool]:
    """Move the turns before the next user turn (a system turn) and that user turn from
    ``conv[cursor:]`` into ``history``.

    Returns:
        (the new cursor, whether a user turn was moved: False = the conversation is done).
    """
    while cursor < len(conv) and conv[cursor]["role"] != "user":
        history.append(conv[cursor])
        cursor += 1
    if cursor >= len(conv):
        return cursor, False
    history.append(conv[cursor])
    return cursor + 1, True


def finish_answer(tokenizer, tokens: list[int], end_ids: set[int]) -> tuple[str, str]:
    """An answer's text and finish reason from its sampled tokens: cut at the first end token
    ("stop"; none within the token budget: "length"), special tokens dropped, whitespace
    stripped. Both backends end answers here."""
    cut = next((i for i, t in enumerate(tokens) if t in end_ids), None)
    if cut is not None:
        tokens = tokens[:cut]
    return (tokenizer.decode(tokens, skip_special_tokens=True).strip(),
            "stop" if cut is not None else "length")


def answer_length(tokens: list[int], end_ids: set[int]) -> int:
    """Sampled tokens of an answer: up to and including its first end token (all if none)."""
    return next((i + 1 for i, t in enumerate(tokens) if t in end_ids), len(tokens))


class GenerateUDF:
    """Ray Data callable class: holds the target and tokenizer once per actor.

    Input batch columns: ``id``, ``domain``, ``messages`` (JSON string of user/system turns).
    Output columns: ``id``, ``domain``, ``messages`` (JSON, with regenerated assistant turns),
    ``finish_reasons`` (JSON list), ``error`` (empty string when the row succeeded).
    """

    def __init__(self, target: str, dtype: str, sampling: dict, template_kwargs: dict,
                 num_threads: int | None, max_prompt_tokens: int, seed: int):
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        self.torch = torch
        self.tokenizer = load_tokenizer(target)
        self.tokenizer.padding_side = "left"
        self.model = load_target(target, dtype)
        # the same end tokens serving stops on (tokenizer EOS + the model's generation config:
        # Qwen3 lists two), so no training answer runs past an end token serving would stop at
        self.eos_ids = eos_token_ids(self.tokenizer, self.model)
        self.sampling = sampling
        self.template_kwargs = template_kwargs
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)
        self.generated_tokens = 0  # sampled answer tokens so far, end tokens included

    def _generate(self, prompts: list[list[int]], keys: list[str]
                  ) -> tuple[list[str], list[str], list[str]]:
        """Sample answers for left-padded prompts with a KV cache. (``model.generate`` costs about
        4x more per step than the forward pass on CPU, so the loop is written out here.)

        Args:
            prompts: rendered prompt token ids, one list per answer to generate.
            keys: "<row id>:<turn>" of each prompt (unused here: this backend seeds per batch).
        Returns:
            (answer texts, finish reasons "stop" / "length", per-row errors: "" = none).
        """
        from transformers import DynamicCache

        torch = self.torch
        s = self.sampling
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        eos = torch.tensor(self.eos_ids, device=self.device)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                            device=self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        n = len(prompts)
        rows = torch.arange(n, device=self.device)  # original row of each live batch entry
        generated = torch.full((n, s["max_new_tokens"]), pad, dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache,
                             use_cache=True, logits_to_keep=1)
            for step in range(s["max_new_tokens"]):
                # the engine's sampler (one definition of temperature / top-k / top-p)
                tok, _ = sample_rows(out.logits[:, -1], s["temperature"], s["top_p"],
                                     top_k=s["top_k"])
                generated[rows, step] = tok
                live = ~torch.isin(tok, eos)
                if not bool(live.any()):
                    break
                if not bool(live.all()):  # drop finished rows so later steps cost less
                    keep = live.nonzero().flatten()
                    cache.batch_select_indices(keep)
                    rows, tok, attn, pos = rows[keep], tok[keep], attn[keep], pos[keep]
                attn = torch.cat((attn, torch.ones_like(attn[:, :1])), dim=1)
                pos = pos[:, -1:] + 1
                out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                                 cache=cache, use_cache=True)
        texts, reasons = [], []
        ends = set(self.eos_ids)
        for row in generated[:, :step + 1].tolist():
            text, reason = finish_answer(self.tokenizer, row, ends)
            self.generated_tokens += answer_length(row, ends)
            texts.append(text)
            reasons.append(reason)
        return texts, reasons, [""] * len(texts)

    def turn_prompt(self, history: list[dict]) -> tuple[list[int] | None, str]:
        """The rendered prompt of a conversation's next answer.

        Args:
            history: the turns so far, ending with the user turn to answer.
        Returns:
            (prompt token ids, ""), or (None, why the row fails: the chat template cannot render
            it, or it is longer than ``max_prompt_tokens``).
        """
        try:
            prompt = render_prompt_ids(self.tokenizer, history, self.template_kwargs)
        except Exception as err:  # a template that cannot render this conversation
            return None, f"chat template failed: {type(err).__name__}: {err}"
        if len(prompt) > self.max_prompt_tokens:
            return None, (f"prompt of {len(prompt)} tokens exceeds max_prompt_tokens "
                          f"{self.max_prompt_tokens}")
        return prompt, ""

    @staticmethod
    def take_answer(history: list[dict], reasons: list[str], text: str, reason: str,
                    failed: str) -> str:
        """Append one generated answer to its conversation.

        Returns:
            "" when appended, else the row's error (the generation failed, or the answer is
            empty).
        """
        if failed:
            return f"generation failed: {failed}"
        if not text:
            return "target generated an empty answer"
        history.append({"role": "assistant", "content": text})
        reasons.append(reason)
        return ""

    def generate_isolated(self, prompts: list[list[int]], keys: list[str]
                          ) -> tuple[list[str], list[str], list[str]]:
        """:meth:`_generate`, and where it raises, each prompt again alone so that one failing
        row does not fail the others (same returns)."""
        try:
            return self._generate(prompts, keys)
        except Exception as err:
            logger.warning("batch generation failed (%s); retrying rows one by one", err)
        texts, why, failed = [], [], []
        for p, key in zip(prompts, keys):
            try:
                t, w, f = self._generate([p], [key])
            except Exception as row_err:
                t, w, f = [""], ["error"], [f"{type(row_err).__name__}: {row_err}"]
            texts.append(t[0])
            why.append(w[0])
            failed.append(f[0])
        return texts, why, failed

    @staticmethod
    def output_rows(batch: dict[str, np.ndarray], rows: list[int], histories: list[list[dict]],
                    reasons: list[list[str]], errors: list[str]) -> dict[str, list]:
        """The output columns (see the class docstring) of the input ``rows`` of ``batch``."""
        return {
            "id": [str(batch["id"][i]) for i in rows],
            "domain": [str(batch["domain"][i]) for i in rows],
            "messages": [json.dumps(histories[i], ensure_ascii=False) for i in rows],
            "finish_reasons": [json.dumps(reasons[i]) for i in rows],
            "error": [errors[i] for i in rows],
        }

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        """Regenerate every conversation of ``batch``, turn by turn (all first answers in one
        padded batch, then all second answers, ...)."""
        ids = [str(x) for x in batch["id"]]
        turns = [json.loads(m) for m in batch["messages"]]
        self.torch.manual_seed(self.seed + zlib.crc32(ids[0].encode()))
        histories: list[list[dict]] = [[] for _ in ids]
        cursors = [0] * len(ids)
        reasons: list[list[str]] = [[] for _ in ids]
        errors = [""] * len(ids)
        while True:
            active, prompts, keys = [], [], []
            for i, conv in enumerate(turns):
                if errors[i]:
                    continue
                cursors[i], has_turn = next_user_turn(conv, histories[i], cursors[i])
                if not has_turn:
                    continue
                prompt, errors[i] = self.turn_prompt(histories[i])
                if prompt is None:
                    continue
                active.append(i)
                prompts.append(prompt)
                keys.append(f"{ids[i]}:{len(reasons[i])}")
            if not active:
                break
            texts, why, failed = self.generate_isolated(prompts, keys)
            for i, text, reason, fail in zip(active, texts, why, failed):
                errors[i] = self.take_answer(histories[i], reasons[i], text, reason, fail)
        return self.output_rows(batch, list(range(len(ids))), histories, reasons, errors)


def done_ids(*paths: Path) -> set[str]:
    """Ids already written to any of the given JSONL files (truncated lines ignored)."""
    ids: set[str] = set()
    for path in paths:
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as fh:
            for raw in fh:
                try:
                    ids.add(json.loads(raw)["id"])
                except (json.JSONDecodeError, KeyError):
                    continue
    return ids


def truncate_torn_line(path: Path) -> None:
    """Cut a partial last line (left by a crash mid-write) so appended rows start on a new line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        logger.warning("%s: dropping a torn last line (%d bytes); its row is regenerated",
                       path, len(data) - keep)
        with open(path, "r+b") as fh:
            fh.truncate(keep)


def _append(fh, row: dict) -> None:
    fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def backend_udf(cfg: GenerateConfig) -> tuple[type, dict]:
    """The actor class of ``cfg.backend`` (hf: :class:`GenerateUDF`; engine:
    ``pipeline.generate.engine.EngineGenerateUDF``) and its arguments beyond the shared ones.

    Raises:
        ValueError: backend vllm (``pipeline.generate.vllm_backend.run_generate_vllm`` runs it).
    """
    if cfg.backend == "hf":
        return GenerateUDF, {}
    if cfg.backend == "engine":
        # lazy: import cycle: engine -> hf
        from .engine import EngineGenerateUDF

        return EngineGenerateUDF, {"max_num_requests": cfg.max_num_requests,
                                   "kv_cache_memory_gib": cfg.kv_cache_memory_gib}
    raise ValueError(f"generate.backend {cfg.backend!r} has no actor pool here: "
                     "pipeline.generate.vllm_backend.run_generate_vllm runs it")


def pending_rows(splits: dict[str, tuple[list[dict], Path]],
                 errors_path: Path) -> tuple[dict, list[dict], dict[str, str]]:
    """What a generate pass still has to do: the rows of every split not yet in its output file
    or ``errors_path`` (torn last lines cut off first, so a stopped run resumes by id).

    Args:
        splits: split -> (prompt rows ``{id, domain, messages}``, output JSONL path).
    Returns:
        (per split the counts ``{"generated": 0, "errors": 0, "skipped"}``, the pending rows in
        split order, pending id -> its split).
    Raises:
        ValueError: a prompt id in two splits.
    """
    owner: dict[str, str] = {}  # prompt id -> its split (every row, done or not)
    for split, (rows, _) in splits.items():
        for r in rows:
            if owner.setdefault(r["id"], split) != split:
                raise ValueError(f"prompt id {r['id']!r} is in splits {owner[r['id']]!r} "
                                 f"and {split!r}")
    truncate_torn_line(errors_path)
    counts, pending, split_of = {}, [], {}
    for split, (rows, out_path) in splits.items():
        truncate_torn_line(out_path)
        done = done_ids(out_path, errors_path)
        todo = [r for r in rows if r["id"] not in done]
        counts[split] = {"generated": 0, "errors": 0, "skipped": len(rows) - len(todo)}
        split_of.update((r["id"], split) for r in todo)
        pending += todo
    return counts, pending, split_of


def run_generate(splits: dict[str, tuple[list[dict], Path]], errors_path: Path,
                 cfg: GenerateConfig, *, target: str, dtype: str, template_kwargs: dict,
                 seed: int, progress=None, udf: type | None = None) -> dict:
    """Regenerate the rows of every split not yet in its output file or ``errors_path``; all
    splits go through one Ray Data pass (one actor pool: an actor's start, which loads the
    target, is paid once, not once a split).

    Args:
        splits: split -> (prompt rows ``{id, domain, messages}``, output JSONL path).
        cfg: the ``generate`` section (backend hf or engine: sampling, actor pool, batch size,
            prompt limit, and the engine's batch and KV budget).
        target, dtype, template_kwargs: the target to load (name or directory), its dtype and
            its chat-template kwargs (the ``target`` section).
        seed: the run's seed.
        progress: a tqdm-like bar updated per written batch, or None.
        udf: an actor class to use instead of the backend's (:func:`backend_udf`), constructed
            with the shared arguments only (tests).
    Returns:
        per split, counts ``{"generated", "errors", "skipped"}`` of this invocation.
    Raises:
        ValueError: backend vllm, or a prompt id in two splits.
    """
    import ray

    udf_cls, udf_kwargs = (udf, {}) if udf is not None else backend_udf(cfg)
    counts, pending, split_of = pending_rows(splits, errors_path)
    if not pending:
        return counts
    # similar prompt lengths share a batch: left padding to the longest prompt otherwise costs
    # more prefill compute than the answers themselves
    pending.sort(key=lambda r: sum(len(m["content"]) for m in r["messages"]))
    items = [{"id": r["id"], "domain": r["domain"],
              "messages": json.dumps(r["messages"], ensure_ascii=False)} for r in pending]
    # Blocks as small as Ray Data makes them (one row): rows leave an actor as soon as its UDF
    # yields them (the engine backend yields finished conversations while its batch decodes),
    # so they are written, and kept by a stopped run, then rather than at the end of a batch of
    # hundreds. The datasets created under the setting keep it (DataContext.get_current's docs).
    context = ray.data.DataContext.get_current()
    block_size, context.target_max_block_size = context.target_max_block_size, 1
    try:
        ds = ray.data.from_items(items,
                                 override_num_blocks=max(1, -(-len(items) // cfg.batch_size)))
    finally:
        context.target_max_block_size = block_size
    ds = ds.map_batches(
        udf_cls,
        fn_constructor_kwargs=dict(target=target, dtype=dtype, sampling=cfg.sampling.model_dump(),
                                   template_kwargs=template_kwargs, num_threads=cfg.num_threads,
                                   max_prompt_tokens=cfg.max_prompt_tokens, seed=seed,
                                   **udf_kwargs),
        batch_size=cfg.batch_size, compute=ray.data.ActorPoolStrategy(size=cfg.num_actors),
        num_cpus=cfg.cpus_per_actor,
        num_gpus=cfg.gpus_per_actor or None, batch_format="numpy")
    pending_splits = set(split_of.values())  # no empty output file for a split with nothing to do
    for split in pending_splits:
        splits[split][1].parent.mkdir(parents=True, exist_ok=True)
    errors_path.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as files:
        outs = {split: files.enter_context(open(splits[split][1], "a", encoding="utf-8"))
                for split in pending_splits}
        err = files.enter_context(open(errors_path, "a", encoding="utf-8"))
        # prefetch_batches=0: a prefetching iterator holds each block until the next one exists
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
            written = set()
            for i in range(len(batch["id"])):
                row_id = str(batch["id"][i])
                split = split_of.pop(row_id, None)
                if split is None:  # a retried actor task may yield a row again
                    continue
                fh = err if batch["error"][i] else outs[split]
                written.add(fh)
                if batch["error"][i]:
                    _append(err, {"id": row_id, "stage": "generate",
                                  "error": str(batch["error"][i])})
                    counts[split]["errors"] += 1
                else:
                    _append(fh, {"id": row_id, "domain": str(batch["domain"][i]),
                                 "messages": json.loads(batch["messages"][i]),
                                 "finish_reasons": json.loads(batch["finish_reasons"][i])})
                    counts[split]["generated"] += 1
            for fh in written:
                fh.flush()
                os.fsync(fh.fileno())
            if progress is not None:
                progress.update(len(batch["id"]))
    return counts
