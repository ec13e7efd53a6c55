"""Eval stage: speculative decoding with the trained drafter on the benchmark files (SPEC section 5).

For every prompt and temperature the same engine decodes twice, target-only and speculative,
alternating which goes first so that machine drift affects both alike. Reported per dataset and
temperature: tau (mean committed tokens per round, bonus included), prefix survival accept_rate@k,
conditional acceptance per position, tokens/s of both and their ratio, draft and verify time per
round, and (greedy) the share of prompts whose speculative output is token-identical to the target's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


class EvalDataError(ValueError):
    """A benchmark file is missing or has a malformed row (file and line named)."""


def load_eval_prompts(path: Path, count: int, seed: int) -> list[str]:
    """First user turns of a benchmark file (``{"turns": [...]}`` rows), a seeded sample of
    ``count`` (DeepSpec's convention: shuffle with ``random.Random(seed)`` when the file has more).

    Raises:
        EvalDataError: missing file or a malformed row.
    """
    if not path.is_file():
        raise EvalDataError(f"benchmark file not found: {path}")
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                turns = json.loads(raw)["turns"]
                if not isinstance(turns, list) or not isinstance(turns[0], str) or not turns[0].strip():
                    raise ValueError("'turns' must be a non-empty list of non-empty strings")
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as err:
                raise EvalDataError(f"{path}:{line_no}: {err}") from err
            prompts.append(turns[0])
    if len(prompts) > count:
        random.Random(seed).shuffle(prompts)
        prompts = prompts[:count]
    return prompts


def summarize(records: list[dict], gamma: int) -> dict:
    """Aggregate per-prompt records of one (dataset, temperature) cell."""
    # rounds that drafted nothing (the budget's last token, beyond the drafter's context) are
    # plain target steps and say nothing about the drafter
    rounds = [r for rec in records for r in rec["spec_rounds"] if r[0] > 0]
    full = [r for r in rounds if r[0] == gamma]  # rounds that drafted the full block
    survival, conditional = [], []
    for k in range(1, gamma + 1):
        survival.append(sum(1 for r in full if r[1] >= k) / len(full) if full else 0.0)
        reached = [r for r in rounds if r[0] >= k and r[1] >= k - 1]
        conditional.append(sum(1 for r in reached if r[1] >= k) / len(reached) if reached else 0.0)
    spec_tokens = sum(rec["spec_tokens"] for rec in records)
    base_tokens = sum(rec["base_tokens"] for rec in records)
    spec_s = sum(rec["spec_s"] for rec in records)
    base_s = sum(rec["base_s"] for rec in records)
    spec_tps = spec_tokens / spec_s if spec_s else 0.0
    base_tps = base_tokens / base_s if base_s else 0.0
    out = {
        "prompts": len(records),
        "rounds": len(rounds),
        "tau": sum(r[2] for r in rounds) / len(rounds) if rounds else 0.0,
        "accept_rate": survival,
        "conditional_acceptance": conditional,
        "spec_tokens_per_s": spec_tps,
        "target_tokens_per_s": base_tps,
        "speedup": spec_tps / base_tps if base_tps else 0.0,
        "draft_ms_per_round": 1e3 * sum(r[3] for r in rounds) / len(rounds) if rounds else 0.0,
        "verify_ms_per_round": 1e3 * sum(r[4] for r in rounds) / len(rounds) if rounds else 0.0,
        "spec_tokens": spec_tokens,
        "target_tokens": base_tokens,
    }
    if records and records[0].get("identical") is not None:
        out["greedy_identical_share"] = sum(rec["identical"] for rec in records) / len(records)
    return out


def evaluate(*, target: str, dtype: str, drafter_dir: str, template_kwargs: dict,
             datasets: dict[str, list[str]], temperatures: list[float], max_new_tokens: int,
             num_threads: int | None, seed: int, progress: bool = True) -> dict:
    """Run the evaluation in this process (the pipeline runs it inside a Ray task).

    Args:
        datasets: dataset name -> prompts (first user turns).
    Returns:
        ``{"gamma", "drafter", "results": {dataset: {str(temperature): summary}}}``.
    """
    import torch
    from tqdm import tqdm

    from drafters.modeling import DSparkDrafter, check_target_compatibility
    from serve.decoding import SpeculativeDecoder
    from serve.target_runner import TargetRunner

    from .chat import render_prompt_ids
    from .target import DTYPES, load_target, load_tokenizer

    if num_threads:
        torch.set_num_threads(num_threads)
    tokenizer = load_tokenizer(target)
    model = load_target(target, dtype)
    drafter = DSparkDrafter.from_pretrained(
        drafter_dir, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
        dtype=DTYPES[dtype])
    check_target_compatibility(drafter.config, target, model.config.vocab_size,
                               model.config.hidden_size, model.config.num_hidden_layers)
    runner = TargetRunner(model, drafter.config.target_layer_ids)
    decoder = SpeculativeDecoder(runner, drafter, [tokenizer.eos_token_id])
    gamma = drafter.config.block_size
    results: dict[str, dict] = {}
    total = sum(len(p) for p in datasets.values()) * len(temperatures)
    bar = tqdm(total=total, desc="eval", unit="prompt", mininterval=5, disable=not progress)
    for name, prompts in datasets.items():
        results[name] = {}
        for temp in temperatures:
            records = []
            for i, text in enumerate(prompts):
                ids = render_prompt_ids(tokenizer, [{"role": "user", "content": text}],
                                        template_kwargs)
                req_seed = seed + i
                order = ("base", "spec") if i % 2 == 0 else ("spec", "base")
                outs = {}
                for kind in order:
                    outs[kind] = decoder.generate(ids, max_new_tokens, temp, req_seed,
                                                  num_draft_tokens=0 if kind == "base" else None)
                spec, base = outs["spec"], outs["base"]
                records.append({
                    "spec_tokens": len(spec.tokens), "spec_s": spec.total_s,
                    "base_tokens": len(base.tokens), "base_s": base.total_s,
                    "spec_rounds": [(r.drafted, r.accepted, r.committed, r.draft_s, r.verify_s)
                                    for r in spec.rounds],
                    "identical": (spec.tokens == base.tokens) if temp <= 0 else None,
                })
                bar.update(1)
            results[name][str(temp)] = summarize(records, gamma)
    bar.close()
    return {"gamma": gamma, "drafter": drafter_dir, "target": target, "dtype": dtype,
            "max_new_tokens": max_new_tokens, "results": results}


def render_report_md(report: dict) -> str:
    """The ``report.md`` table."""
    gamma = report["gamma"]
    lines = [
        f"# Evaluation: {report['target']} ({report['dtype']}), drafter gamma = {gamma}",
        "",
        f"max_new_tokens = {report['max_new_tokens']}; tau counts the bonus token; tokens/s are "
        "measured in the same run on the same prompts, target-only and speculative alternating. "
        "'greedy identical' compares the two outputs token by token: in bf16, verifying several "
        "tokens in one pass can flip near-ties against one-token steps, so it may read below 100 %; "
        "losslessness itself is tested in fp32 (tests/unit/test_speculative_lossless.py).",
        "",
        "| dataset | temperature | prompts | tau | accept_rate@1..k | spec tok/s | target tok/s "
        "| speed-up | draft ms/round | verify ms/round | greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_temp in report["results"].items():
        for temp, s in by_temp.items():
            rates = " / ".join(f"{r:.2f}" for r in s["accept_rate"])
            same = s.get("greedy_identical_share")
            lines.append(
                f"| {name} | {temp} | {s['prompts']} | {s['tau']:.2f} | {rates} | "
                f"{s['spec_tokens_per_s']:.1f} | {s['target_tokens_per_s']:.1f} | "
                f"{s['speedup']:.2f}x | {s['draft_ms_per_round']:.1f} | "
                f"{s['verify_ms_per_round']:.1f} | {'' if same is None else f'{same:.0%}'} |")
    lines += ["", "Conditional acceptance per position (P(token k accepted | tokens < k accepted)):", ""]
    lines.append("| dataset | temperature | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " |")
    lines.append("|---|---|" + "---|" * gamma)
    for name, by_temp in report["results"].items():
        for temp, s in by_temp.items():
            lines.append(f"| {name} | {temp} | " +
                         " | ".join(f"{c:.2f}" for c in s["conditional_acceptance"]) + " |")
    return "\n".join(lines) + "\n"
