"""Is the engine lossless on every target family? Issue 40's measurement, as a table: for a tiny
random target of each family (``tests/families.py``: hidden 64, 4 layers, 4 query / 2 KV heads,
a sliding window of 8 tokens), fp32, an untrained DSpark drafter bound to it, the fixed scheduler,
5 prompts of 9-40 tokens x 32 new tokens: is the engine's greedy output (through the decode
attention kernel and through the PyTorch paths) token-identical to the target's own greedy
``generate``? A target the engine refuses is reported with its error. Writes
``benchmarks/results/target_families.{md,json}``.

    .venv/bin/python benchmarks/target_families.py
"""

from __future__ import annotations

import argparse
import json
import platform
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

LENGTHS = (12, 20, 30, 9, 40)


def cpu_class() -> str:
    """The CPU's bf16 class (what the project's numbers depend on)."""
    flags = ""
    try:
        flags = next(l for l in Path("/proc/cpuinfo").read_text().splitlines()
                     if l.startswith("flags"))
    except (OSError, StopIteration):
        pass
    found = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return ", ".join(found) or platform.machine()


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
                                         attention=attention, max_num_requests=len(prompts)))
        done = engine.generate([EngineRequest(f"r{i}", p, SamplingParams(new_tokens, 0.0))
                                for i, p in enumerate(prompts)])
        firsts = [first_difference(c.tokens, r) for c, r in zip(done, refs)]
        row[attention] = {"equal": sum(f is None for f in firsts), "of": len(prompts),
                          "first_difference": firsts}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "target_families"))
    args = ap.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    rows = [measure(name, args.new_tokens) for name in FAMILIES]
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": cpu_class(), "torch": torch.__version__,
            "transformers": transformers.__version__, "new_tokens": args.new_tokens,
            "prompt_lengths": list(LENGTHS), "seconds": round(time.perf_counter() - start, 1)}
    lines = [f"# Engine greedy vs the target's own greedy, per family ({meta['date']})", "",
             f"`benchmarks/target_families.py --new-tokens {args.new_tokens}`: tiny random "
             f"targets (tests/families.py, sliding window 8), fp32, untrained DSpark drafter, "
             f"fixed scheduler, prompts of {list(LENGTHS)} tokens; CPU flags: {meta['cpu']}; "
             f"torch {meta['torch']}, transformers {meta['transformers']}.", "",
             "| family | model type | kernel path: equal | PyTorch path: equal | first differing "
             "new token (kernel) |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['model_type']} | refused: {r['error'][:120]} "
                         f"| | |")
            continue
        k, p = r["kernel"], r["pytorch"]
        lines.append(f"| {r['family']} | {r['model_type']} | {k['equal']}/{k['of']} | "
                     f"{p['equal']}/{p['of']} | {k['first_difference']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
