"""The decode attention kernel per instruction-set build, against PyTorch, on this machine.

One layer's decode attention of a generation step: ``--rows`` query rows (a batch of requests, one
token each) over their own slots of a KV pool, lengths spread evenly over ``--min-positions`` to
``--max-positions``, SmolLM2-135M's heads (9 query / 3 key-value heads of 64). Arms, alternating
over ``--rounds`` (each the median of ``--repeats`` calls):

- ``native``: the engine's build (``-march=native``: this CPU's fastest paths);
- ``avx2``: built for AVX2 + FMA only (the fp32 intrinsics path; skipped where the CPU lacks it);
- ``portable``: built for baseline x86-64 (compiler-vectorised loops only);
- ``pytorch``: one SDPA call per request (the engine's attention without the kernel).

For each dtype (fp32, bf16): the median milliseconds per call and the speed-up over ``portable``.
The build reports which inner path each dtype takes (``kernel_paths``).

    .venv/bin/python benchmarks/decode_kernel_paths.py [--rounds 5] [--repeats 20]

Writes ``benchmarks/results/decode_kernel_paths/<date>_<machine class>.{md,json}``. First run builds the three variants
(~30 s each on 2 cores). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe as describe_machine, machine as machine_fields  # noqa: E402,I001
from benchmarks.machine import OUT_HELP, result_stem  # noqa: E402
from serve.engine.decode_attention import (ISA_FLAGS, decode_kernel, isa_supported,  # noqa: E402
                                           kernel_paths)

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M's attention


def _inputs(rows: int, lo: int, hi: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(rows, HKV, hi, D, generator=g).to(dtype)
    values = torch.randn(rows, HKV, hi, D, generator=g).to(dtype)
    q = torch.randn(rows, HQ, D, generator=g).to(dtype)
    lengths = torch.linspace(lo, hi, rows).round().long()
    return q, keys, values, torch.arange(rows), lengths


def _pytorch(q, keys, values, slots, lengths, scale):
    out = torch.empty_like(q)
    for r, (s, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        out[r] = torch.nn.functional.scaled_dot_product_attention(
            q[r][None, :, None], keys[s:s + 1, :, :n], values[s:s + 1, :, :n], scale=scale,
            enable_gqa=True)[0, :, 0]
    return out


def _time(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--min-positions", type=int, default=100)
    ap.add_argument("--max-positions", type=int, default=900)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    args.out = args.out or str(result_stem("decode_kernel_paths"))

    isas = [isa for isa in sorted(ISA_FLAGS) if isa_supported(isa)]
    kernels = {isa: decode_kernel(isa) for isa in isas}
    kernels = {isa: k for isa, k in kernels.items() if k is not None}
    paths = {isa: kernel_paths(isa) for isa in kernels}
    arms = [*kernels, "pytorch"]
    scale = D ** -0.5
    rows_out, runs = [], []
    for dtype in (torch.float32, torch.bfloat16):
        x = _inputs(args.rows, args.min_positions, args.max_positions, dtype)
        calls = {isa: (lambda k=k: k(*x, scale)) for isa, k in kernels.items()}
        calls["pytorch"] = lambda: _pytorch(*x, scale)
        reference = _pytorch(*x, scale).float()
        for arm, call in calls.items():  # every arm computes the same attention
            torch.testing.assert_close(call().float(), reference, atol=2e-2, rtol=2e-2)
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for r in range(args.rounds):
            order = arms if r % 2 == 0 else arms[::-1]  # alternate, both directions
            for arm in order:
                times[arm].append(_time(calls[arm], args.repeats))
        runs.append({"dtype": str(dtype).removeprefix("torch."), "ms": times})
        base = statistics.median(times["portable"]) if "portable" in times else None
        for arm in arms:
            ms = statistics.median(times[arm])
            rows_out.append({"dtype": str(dtype).removeprefix("torch."), "arm": arm,
                             "path": ("SDPA per request" if arm == "pytorch"
                                      else paths[arm][str(dtype).removeprefix("torch.")]),
                             "median_ms": round(ms, 3),
                             "vs_portable": round(base / ms, 2) if base else None})
    meta = {"command": " ".join(["benchmarks/decode_kernel_paths.py", *(argv or sys.argv[1:])]),
            "machine": describe_machine(), "hardware": machine_fields(),
            "threads": torch.get_num_threads(),
            "settings": {"rows": args.rows, "positions": [args.min_positions, args.max_positions],
                         "heads": [HQ, HKV, D], "rounds": args.rounds, "repeats": args.repeats},
            "flags": {isa: ISA_FLAGS[isa] for isa in kernels}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "summary": rows_out,
                                                    "runs": runs}, indent=2) + "\n")
    lines = ["# Decode attention kernel per instruction-set build", "",
             f"Command: `{meta['command']}`. Machine: {meta['machine']}; {meta['threads']} "
             f"threads. One layer: {args.rows} rows, {args.min_positions}-{args.max_positions} "
             f"positions, {HQ}/{HKV} heads of {D}. Median of {args.repeats} calls per round, "
             f"{args.rounds} rounds, arms alternating; the median round below.", "",
             "| dtype | build | inner path | ms per call | x portable |", "|---|---|---|---|---|"]
    lines += [f"| {r['dtype']} | {r['arm']} | {r['path']} | {r['median_ms']} | "
              f"{r['vs_portable'] if r['vs_portable'] is not None else '-'} |" for r in rows_out]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
