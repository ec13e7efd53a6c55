"""SPS(B) profiling: target steps per second at a verification batch of B tokens (SPEC 6).

At engine start-up the target's batched forward pass is timed over the batch-token sizes the
engine can run (several requests, each with a cached context, verifying blocks of
``num_speculative_tokens`` + 1 tokens). The measurements become an
:class:`serve.engine.scheduler.SPSTable` and are stored as JSON next to the drafter checkpoint
together with a fingerprint of the hardware, software and model; a stored profile is reused only
when the fingerprint matches, otherwise the target is re-profiled.

CLI (prints the table):
    python -m serve.engine.profiling --target PATH --dtype bfloat16 --max-batch-tokens 64
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import torch

from drafters.precision import capability

from .config import EngineConfig
from .decode_attention import engine_isa
from .draft_planner import DraftCostTable
from .scheduler_registry import NEEDS_SPS
from .sps import SPSTable
from .target_loading import load_target
from .target_runner import TargetKV, TargetRunner

logger = logging.getLogger(__name__)
PROFILE_NAME = "sps_profile.json"
DRAFT_COST_NAME = "draft_cost_profile.json"


def device_name(device: torch.device) -> str:
    """The accelerator's name (``torch.cuda.get_device_name``) or, on CPU, the processor's model
    name from /proc/cpuinfo (falling back to ``platform``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            name = next((l.split(":", 1)[1].strip() for l in fh if l.startswith("model name")),
                        name)
    except OSError:
        pass
    return name


def hardware_fingerprint(runner: TargetRunner) -> dict:
    """What SPS depends on: device, its instruction set (a CPU's capability as torch reports it,
    "AVX2" / "AVX512"..., and whether it multiplies bf16 natively: one "AMD EPYC" model name
    covers AVX2-only and AVX-512-BF16 generations, 4x apart in bf16), threads, software versions,
    model, dtype and how decode rows attend (the decode attention kernel and which instruction-set
    build of it, or PyTorch: ``EngineConfig.attention``). A stored profile whose fingerprint differs in any of these is
    measured again."""
    device = device_name(runner.device)
    cap = capability(runner.device)
    cfg = runner.model.config
    return {"device": device, "device_type": runner.device.type,
            "capability": cap.name, "native_bf16": cap.native_bf16, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "model": getattr(cfg, "_name_or_path", ""), "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "dtype": str(runner.dtype),
            "attention": (f"kernel ({engine_isa()} build)" if runner.decode_kernel is not None
                          else "pytorch")}


def batch_grid(max_tokens: int) -> list[int]:
    """Batch-token sizes to time: every size up to 8, then roughly geometric up to max_tokens."""
    sizes = set(range(1, min(8, max_tokens) + 1))
    b = 8
    while b < max_tokens:
        b = min(max_tokens, int(math.ceil(b * 1.5)))
        sizes.add(b)
    return sorted(sizes)


def trimmed_mean(samples: list[float], trim: float = 0.25) -> float:
    """Mean of ``samples`` without the lowest and highest ``trim`` share of them (at least one
    each from 3 samples on): robust to the one call a page fault, a GC or a neighbour slowed.
    Of 3 samples it is the median; of 5, the mean of the middle 3.

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("trimmed_mean of no samples")
    ordered = sorted(samples)
    cut = max(1, int(len(ordered) * trim)) if len(ordered) >= 3 else 0
    kept = ordered[cut:len(ordered) - cut]
    return sum(kept) / len(kept)


@torch.no_grad()
def profile_sps(runner: TargetRunner, max_tokens: int, block_tokens: int = 8,
                context_len: int = 128, repeats: int = 3, seed: int = 0) -> dict[int, float]:
    """Time batched verification forward passes.

    A batch of B tokens is ceil(B / block_tokens) requests, each with ``context_len`` cached
    tokens, verifying ``block_tokens`` tokens (the last one fewer), as a speculative step does.

    Args:
        runner: the target.
        max_tokens: the largest B to time.
        block_tokens: tokens per request (num_speculative_tokens + 1).
        context_len: cached tokens per request.
        repeats: timed passes per size (their :func:`trimmed_mean` is kept, after one warm-up).
    Returns:
        {B: steps per second}.
    """
    g = torch.Generator().manual_seed(seed)
    vocab = runner.model.config.vocab_size
    n_req = math.ceil(max_tokens / block_tokens)
    caches = []
    for _ in range(n_req):
        kv = TargetKV()
        out = runner.forward_batch([kv], [torch.randint(0, vocab, (context_len,), generator=g).tolist()],
                                   with_features=False, logits="none")[0]
        out.keep(context_len)
        caches.append(kv)
    result = {}
    for b in batch_grid(max_tokens):
        r = math.ceil(b / block_tokens)
        sizes = [block_tokens] * (r - 1) + [b - block_tokens * (r - 1)]
        tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in sizes]
        runner.forward_batch(caches[:r], tokens, with_features=True)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.forward_batch(caches[:r], tokens, with_features=True)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            times.append(time.perf_counter() - start)
        result[b] = 1.0 / trimmed_mean(times)
    for kv in caches:
        kv.release()
    return result


def _reusable(path: Path | None, fingerprint: dict, size_key: str, size: int) -> dict | None:
    """The stored profile at ``path`` if it was measured on this fingerprint and covers ``size``
    (its ``size_key``), else None (and the caller re-profiles)."""
    if path is None or not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        logger.warning("profile at %s is unreadable (%s): re-profiling", path, err)
        return None
    if stored.get("stale"):
        logger.info("profile at %s was contradicted by an engine's own steps (%s): re-profiling",
                    path, stored["stale"])
        return None
    if stored.get("fingerprint") == fingerprint and stored.get(size_key, 0) >= size:
        logger.info("profile reused from %s", path)
        return stored
    logger.info("profile at %s is for other hardware, model or sizes: re-profiling", path)
    return None


def _store(path: Path | None, payload: dict) -> None:
    """Write a profile next to the drafter; a read-only directory only costs a re-profile later."""
    if path is None:
        return
    try:
        _write_atomically(path, json.dumps(payload, indent=1))
    except OSError as err:
        logger.warning("could not store the profile at %s: %s", path, err)


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` through a temporary file beside it: an engine starting while
    another rewrites the profile reads the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def mark_profile_stale(directory: str | Path, name: str) -> None:
    """Mark the stored profile ``name`` ("sps" or "draft_cost") in ``directory`` to be measured
    again at the next start (an engine's own steps contradicted it:
    ``serve/engine/cost_check.py``); a missing or unwritable file is left as it is."""
    path = Path(directory) / (PROFILE_NAME if name == "sps" else DRAFT_COST_NAME)
    try:
        stored = json.loads(path.read_text())
        stored["stale"] = time.strftime("contradicted at %Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _write_atomically(path, json.dumps(stored, indent=1))
    except (OSError, ValueError, TypeError) as err:
        logger.warning("could not mark the profile at %s for re-profiling: %s", path, err)


def load_or_profile(runner: TargetRunner, directory: str | Path | None, max_tokens: int,
                    block_tokens: int = 8, repeats: int = 3) -> SPSTable:
    """The SPS table for this hardware and model: reuse ``directory/sps_profile.json`` when its
    fingerprint matches and it covers ``max_tokens``, else profile and (if ``directory`` is
    writable) store it."""
    fingerprint = hardware_fingerprint(runner)
    path = Path(directory) / PROFILE_NAME if directory else None
    stored = _reusable(path, fingerprint, "max_tokens", max_tokens)
    if stored is not None:
        return SPSTable.from_dict(stored["table"])
    start = time.perf_counter()
    measured = profile_sps(runner, max_tokens, block_tokens, repeats=repeats)
    table = SPSTable.from_measurements(measured)
    logger.info("profiled SPS(B) for B <= %d in %.1f s", max_tokens, time.perf_counter() - start)
    # block_tokens and measured_at are provenance for the engine files (serve/engine/engine_files.py)
    _store(path, {"fingerprint": fingerprint, "max_tokens": max_tokens,
                  "block_tokens": block_tokens,
                  "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "measured": {str(k): v for k, v in measured.items()}, "table": table.to_dict()})
    return table


# bumped when the drafter's inference cost changes for the same weights, so stored tables made
# before are re-measured (2: the draft head no longer runs a strided slice as a batched matmul,
# which had made drafts shorter than block_size cost up to 10x more at 64 rows; 3: the cost per
# context position of a backlog, for requests whose context fell behind; 4: contexts are
# extended in one packed call for all rows, in bounded shapes, as the engine now does)
DRAFT_COST_METHOD = 4


def _drafter_fingerprint(drafter) -> dict:
    cfg = drafter.config
    param = next(drafter.parameters())
    return {"drafter_type": getattr(cfg, "drafter_type", type(drafter).__name__),
            "parameters": sum(p.numel() for p in drafter.parameters()),
            "block_size": cfg.block_size, "draft_vocab_size": getattr(cfg, "draft_vocab_size", 0),
            "dtype": str(param.dtype), "device": str(param.device)}


@torch.no_grad()
def profile_draft_cost(drafter, max_rows: int, context_len: int = 128, repeats: int = 3,
                       seed: int = 0) -> DraftCostTable:
    """Time one batched drafter call as the engine makes it: extend every request's context by 2
    committed positions (one ``extend_context_batch`` call), then propose a block of 1 and of block_size draft tokens, greedy and
    sampled (temperature 1), for every row count of :func:`batch_grid` up to ``max_rows``; and the
    cost per position of extending one row's context by a backlog of 128 positions.

    Args:
        drafter: a drafter (``drafters.loading.load_drafter``) on its serving device and dtype.
        max_rows: the most requests drafted for together (the engine's max_num_requests).
        context_len: committed positions already in each request's draft context.
        repeats: timed calls per point (their :func:`trimmed_mean` is kept, after one warm-up).
    Returns:
        a :class:`serve.engine.draft_planner.DraftCostTable` in seconds.
    """
    cfg = drafter.config
    param = next(drafter.parameters())
    dev, dtype = param.device, param.dtype
    g = torch.Generator().manual_seed(seed)
    width = cfg.target_hidden_size * len(cfg.target_layer_ids)
    vocab = cfg.target_vocab_size
    rows_grid = batch_grid(max_rows)
    states = []
    for _ in range(rows_grid[-1]):
        st = drafter.new_draft_state()
        feats = torch.randn(1, context_len, width, generator=g).to(device=dev, dtype=dtype)
        drafter.extend_context(st, feats, torch.arange(context_len, device=dev)[None],
                               torch.randint(0, vocab, (1, context_len), generator=g).to(dev))
        states.append(st)

    def one_call(rows: int, num_draft_tokens: int, temperature: float) -> float:
        feats = [torch.randn(2, width, generator=g).to(device=dev, dtype=dtype)
                 for _ in range(rows)]
        ids = [torch.randint(0, vocab, (2,), generator=g).to(dev) for _ in range(rows)]
        start = time.perf_counter()
        drafter.extend_context_batch(states[:rows], feats, ids)  # as the engine extends them
        anchors = torch.randint(0, vocab, (rows,), generator=g).to(dev)
        positions = torch.tensor([st.length for st in states[:rows]], device=dev)
        temps = torch.full((rows,), temperature)
        gens = [torch.Generator().manual_seed(seed + i) for i in range(rows)]
        if rows == 1:
            drafter.propose_block(states[0], anchors, positions, num_draft_tokens, temps, gens,
                                  torch.ones(1))
        else:
            drafter.propose_block_batch(states[:rows], anchors, positions, num_draft_tokens, temps,
                                        gens, torch.ones(rows),
                                        torch.full((rows,), num_draft_tokens))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    greedy, sampled = [], []
    for rows in rows_grid:
        for temperature, out in ((0.0, greedy), (1.0, sampled)):
            pair = []
            for num_draft_tokens in (1, cfg.block_size):
                one_call(rows, num_draft_tokens, temperature)  # warm-up
                pair.append(trimmed_mean([one_call(rows, num_draft_tokens, temperature)
                                          for _ in range(repeats)]))
            out.append(tuple(pair))

    def extend_call(positions: int) -> float:  # one row's context extended by that many
        feats = torch.randn(positions, width, generator=g).to(device=dev, dtype=dtype)
        ids = torch.randint(0, vocab, (positions,), generator=g).to(dev)
        start = time.perf_counter()
        drafter.extend_context_batch(states[:1], [feats], [ids])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    backlog = 128  # a typical prompt, or the tokens of a long probe back-off
    extend_call(backlog), extend_call(2)  # warm-up
    long = trimmed_mean([extend_call(backlog) for _ in range(repeats)])
    short = trimmed_mean([extend_call(2) for _ in range(repeats)])
    return DraftCostTable(tuple(rows_grid), tuple(greedy), tuple(sampled), cfg.block_size,
                          max(0.0, (long - short) / (backlog - 2)))


def load_or_profile_draft_cost(drafter, runner: TargetRunner, directory: str | Path | None,
                               max_rows: int, repeats: int = 3) -> DraftCostTable:
    """The drafter cost table for this hardware and drafter: reuse
    ``directory/draft_cost_profile.json`` when its fingerprint matches and it covers
    ``max_rows``, else profile and (if ``directory`` is writable) store it."""
    fingerprint = {**hardware_fingerprint(runner), "drafter": _drafter_fingerprint(drafter),
                   "method": DRAFT_COST_METHOD}
    path = Path(directory) / DRAFT_COST_NAME if directory else None
    stored = _reusable(path, fingerprint, "max_rows", max_rows)
    if stored is not None:
        return DraftCostTable.from_dict(stored["table"])
    start = time.perf_counter()
    table = profile_draft_cost(drafter, max_rows, repeats=repeats)
    logger.info("profiled the drafter cost for <= %d rows in %.1f s", max_rows,
                time.perf_counter() - start)
    _store(path, {"fingerprint": fingerprint, "max_rows": max_rows, "table": table.to_dict()})
    return table


def engine_profiles(runner: TargetRunner, drafter, config: EngineConfig,
                    directory: str | Path | None) -> tuple[SPSTable | None, DraftCostTable | None]:
    """What the engine's scheduler needs for ``config``: the SPS(B) table (dspark and async, up
    to ``config.max_batch_tokens``) and the drafter cost table (goodput planning, up to
    ``config.max_num_requests`` rows), loaded from ``directory`` or profiled there.

    Returns:
        (sps, draft_cost); None for what the configuration does not use (no drafter, other
        schedulers, ``sps_profile: off`` gives a flat SPS table).
    """
    if drafter is None or config.scheduler not in NEEDS_SPS:
        return None, None
    num_speculative_tokens = config.speculative_tokens(drafter.config.block_size)
    if config.sps_profile == "off":
        sps = SPSTable((1.0,) * config.max_batch_tokens)
    else:
        sps = load_or_profile(runner, directory, config.max_batch_tokens,
                              block_tokens=num_speculative_tokens + 1,
                              repeats=config.sps_repeats)
    cost = None  # a flat SPS table has no time unit to compare the drafter's seconds with
    if config.plans_drafts and config.sps_profile == "auto":
        cost = load_or_profile_draft_cost(drafter, runner, directory, config.max_num_requests,
                                          repeats=config.sps_repeats)
    return sps, cost


def format_table(table: SPSTable, step: int = 1) -> str:
    """SPS(B) and the token throughput B * SPS(B) as a text table."""
    lines = [f"{'B':>5} {'SPS (steps/s)':>14} {'B x SPS (tokens/s)':>19}"]
    for b in range(1, table.max_tokens + 1, step):
        lines.append(f"{b:>5} {table.sps(b):>14.2f} {b * table.sps(b):>19.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Profile SPS(B) of a target model and print it.")
    parser.add_argument("--target", required=True, help="from_pretrained name or directory")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-tokens", type=int, default=64)
    parser.add_argument("--block-tokens", type=int, default=8,
                        help="tokens verified per request: num_speculative_tokens + 1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="directory to store sps_profile.json in")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    runner = TargetRunner(load_target(os.path.expanduser(args.target), args.dtype), [])
    table = load_or_profile(runner, args.out, args.max_batch_tokens, args.block_tokens, args.repeats)
    print(format_table(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
