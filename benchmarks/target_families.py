"""Is the engine lossless on every target family? Issue 40's measurement, as a table: for a tiny
random target of each family (``tests/families.py``: hidden 64, 4 layers, 4 query / 2 KV heads,
a sliding window of 8 tokens), fp32, an untrained DSpark drafter bound to it, the fixed scheduler,
5 prompts of 9-40 tokens x 32 new tokens: is the engine's greedy output (through the decode
attention kernel and through the PyTorch paths) token-identical to the target's own greedy
``generate``? A target the engine refuses is reported with its error. Prompts are prefilled in
16-token chunks, so a sliding layer's slots (2 x 8 - 1 + 16 = 31 positions) are shorter than the
sequences and its keys are moved back while requests decode (``serve/engine/kv_storage.py``).

A second table: the KV pool bytes one request takes at a 32 k model length, bf16, the engine's
default 2,048-token prompt chunks, for transformers' default config of each sliding-window family
(its documented shapes; no weights needed: the pool is built on the ``meta`` device), with every
layer full-length (as before issue 40) and with sliding layers holding their window. Writes
``benchmarks/results/target_families/<date>_<machine class>.{md,json}``.

    .venv/bin/python benchmarks/target_families.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from serve.engine.config import EngineConfig  # noqa: E402
from serve.engine.core import SpecEngine  # noqa: E402
from serve.engine.requests import EngineRequest, SamplingParams  # noqa: E402
from serve.engine.target_runner import TargetRunner  # noqa: E402
from tests.families import FAMILIES, family_target  # noqa: E402
from tests.tiny import tiny_drafter  # noqa: E402
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402

LENGTHS = (12, 20, 30, 9, 40)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def measure(name: str, new_tokens: int) -> dict:
    target = family_target(name)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in LENGTHS]
    refs = [target.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                            min_new_tokens=new_tokens, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    row = {"family": name, "model_type": target.config.model_type}
    try:
        runner = TargetRunner(target, [1, 2])
    except Exception as err:  # noqa: BLE001 - a refusal is the result for this family
        row["error"] = f"{type(err).__name__}: {err}"
        return row
    for attention in ("kernel", "pytorch"):
        engine = SpecEngine(runner, tiny_drafter(target, layer_ids=(1, 2), block_size=4), [],
                            EngineConfig(scheduler="fixed", sps_profile="off",
                                         attention=attention, max_num_requests=len(prompts),
                                         max_prefill_tokens=16))
        done = engine.generate([EngineRequest(f"r{i}", p, SamplingParams(new_tokens, 0.0))
                                for i, p in enumerate(prompts)])
        firsts = [first_difference(c.tokens, r) for c, r in zip(done, refs)]
        row[attention] = {"equal": sum(f is None for f in firsts), "of": len(prompts),
                          "first_difference": firsts}
        pool = runner.kv_pool_state()
        row[attention]["sliding_keys_moved"] = bool(runner.layer_windows) and any(
            runner._kv_pool().offsets[w] != [0] * pool["slots"] for w in pool["window_positions"])
    return row


def pool_bytes(config, model_len: int, pass_tokens: int, windowed: bool) -> int:
    """KV bytes of one request of ``model_len`` positions for ``config``'s shapes, bf16; sliding
    layers (``config.layer_types``, or every layer where only ``sliding_window`` is set) holding
    their window when ``windowed``."""
    from serve.engine.kv_storage import SlotKVPool

    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * layers
    window = getattr(config, "sliding_window", None)
    windows = ({i: window for i, t in enumerate(types) if t == "sliding_attention"}
               if windowed and window else {})
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = SlotKVPool(layers, config.num_key_value_heads, head_dim, torch.bfloat16,
                      torch.device("meta"), slots=1, capacity=model_len, windows=windows,
                      pass_tokens=pass_tokens)
    return pool.nbytes


def memory_rows(model_len: int = 32768, pass_tokens: int = 2048) -> list[dict]:
    import transformers as tf

    rows = []
    for cls in (tf.Gemma3TextConfig, tf.Gemma2Config, tf.GptOssConfig, tf.MistralConfig):
        cfg = cls()
        full, kept = (pool_bytes(cfg, model_len, pass_tokens, w) for w in (False, True))
        rows.append({"config": cls.__name__, "layers": cfg.num_hidden_layers,
                     "sliding_window": cfg.sliding_window, "full_bytes": full,
                     "windowed_bytes": kept, "ratio": round(kept / full, 3)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    args.out = args.out or str(result_stem("target_families"))
    import transformers

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    rows = [measure(name, args.new_tokens) for name in FAMILIES]
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": describe_machine(),
            "hardware": machine_fields(), "torch": torch.__version__,
            "transformers": transformers.__version__, "new_tokens": args.new_tokens,
            "prompt_lengths": list(LENGTHS), "seconds": round(time.perf_counter() - start, 1)}
    lines = [f"# Engine greedy vs the target's own greedy, per family ({meta['date']})", "",
             f"`benchmarks/target_families.py --new-tokens {args.new_tokens}`: tiny random "
             f"targets (tests/families.py, sliding window 8), fp32, untrained DSpark drafter, "
             f"fixed scheduler, prompts of {list(LENGTHS)} tokens; machine: {meta['machine']}; "
             f"torch {meta['torch']}, transformers {meta['transformers']}.", "",
             "| family | model type | kernel path: equal | PyTorch path: equal | first differing "
             "new token (kernel) | sliding keys moved |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['model_type']} | refused: {r['error'][:120]} "
                         f"| | | |")
            continue
        k, p = r["kernel"], r["pytorch"]
        lines.append(f"| {r['family']} | {r['model_type']} | {k['equal']}/{k['of']} | "
                     f"{p['equal']}/{p['of']} | {k['first_difference']} | "
                     f"{'yes' if k['sliding_keys_moved'] and p['sliding_keys_moved'] else '-'} |")
    memory = memory_rows()
    lines += ["", "KV pool bytes per request at a 32,768-token model length (bf16, 2,048-token "
              "prompt chunks; transformers' default config of each class):", "",
              "| config | layers | sliding window | every layer full length | sliding layers "
              "hold their window | ratio |", "|---|---|---|---|---|---|"]
    for m in memory:
        lines.append(f"| {m['config']} | {m['layers']} | {m['sliding_window']} | "
                     f"{m['full_bytes'] / 2**20:,.0f} MiB | {m['windowed_bytes'] / 2**20:,.0f} MiB "
                     f"| {m['ratio']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                    "kv_bytes_per_request": memory}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
