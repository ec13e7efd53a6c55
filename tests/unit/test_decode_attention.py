"""The decode attention kernel (serve/engine/csrc/decode_attention.cpp, built by
serve/engine/decode_attention.py): each row's attention over its slot's first positions equals
SDPA's, in fp32 and bf16, for grouped-query shapes on every inner path (each instruction-set build
this CPU can run: native, AVX2 + FMA, portable); bad
input is refused; an engine decoding with it gives the greedy text of the PyTorch path; where it
cannot be built the engine says so and attends with PyTorch."""

from __future__ import annotations

import logging

import pytest
import torch

from serve.engine.config import EngineConfig
from serve.engine.core import SpecEngine
from serve.engine.decode_attention import (ISA_FLAGS, build_directory, decode_kernel,
                                           expected_paths, forget_kernels, isa_supported,
                                           kernel_paths)
from serve.engine.requests import EngineRequest, SamplingParams
from serve.engine.target_runner import TargetRunner
from tests.tiny import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def kernel():
    op = decode_kernel()
    assert op is not None, "the decode attention kernel did not build (see the warning above)"
    return op


@pytest.fixture(scope="module", params=sorted(ISA_FLAGS))
def isa_kernel(request):
    """The kernel built for each instruction-set target this CPU runs (a target it cannot run
    is skipped: an AVX2 build on a CPU without AVX2), so every inner path is checked here."""
    if not isa_supported(request.param):
        pytest.skip(f"this CPU cannot run a {request.param} build")
    op = decode_kernel(request.param)
    assert op is not None, f"the {request.param} kernel did not build (see the warning above)"
    return op


def test_each_build_reports_the_paths_its_instruction_sets_allow():
    import platform

    if platform.machine() in ("x86_64", "AMD64"):
        baseline = "vectorised loops, baseline x86-64 (SSE2)"
        assert kernel_paths("portable") == {"float32": baseline, "bfloat16": baseline}
    if isa_supported("avx2"):
        avx2 = "vectorised loops, AVX2+FMA"
        assert kernel_paths("avx2") == {"float32": avx2, "bfloat16": avx2}
    for isa in ISA_FLAGS:  # what the doctor predicts without building is what a build says
        if isa_supported(isa):
            assert kernel_paths(isa) == expected_paths(isa)
    native = kernel_paths("native")
    flags = set(open("/proc/cpuinfo").read().split())
    widest = ("AVX-512" if "avx512f" in flags else "AVX2+FMA" if isa_supported("avx2")
              else "baseline")
    assert widest in native["float32"]
    assert native["bfloat16"].startswith("avx512_bf16") == ("avx512_bf16" in flags)
    with pytest.raises(ValueError, match="unknown instruction-set target"):
        isa_supported("avx9")


def _reference(q, keys, values, slots, lengths, scale):
    """Per row: SDPA (fp32) of its query heads over its slot's first ``lengths[r]`` positions."""
    hkv = keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for r, (s, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        k = keys[s, :, :n].float().repeat_interleave(q.shape[1] // hkv, dim=0)
        v = values[s, :, :n].float().repeat_interleave(q.shape[1] // hkv, dim=0)
        out[r] = torch.nn.functional.scaled_dot_product_attention(
            q[r].float()[:, None], k, v, scale=scale)[:, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 64), (8, 1, 32), (4, 2, 16), (2, 1, 12)])
def test_rows_match_sdpa_over_their_slots(isa_kernel, dtype, hq, hkv, d):
    kernel = isa_kernel
    g = torch.Generator().manual_seed(hq * 100 + d)
    num_slots, capacity = 7, 300
    keys = torch.randn(num_slots, hkv, capacity, d, generator=g).to(dtype)
    values = torch.randn(num_slots, hkv, capacity, d, generator=g).to(dtype)
    # rows in any slot order, one slot read by several rows (a verify block), lengths from one
    # position to the whole slot
    slots = torch.tensor([4, 0, 6, 2, 2, 2, 5, 1])
    lengths = torch.tensor([1, capacity, 57, 120, 121, 122, 2, 200])
    q = torch.randn(len(slots), hq, d, generator=g).to(dtype)
    scale = d ** -0.5
    out = kernel(q, keys, values, slots, lengths, scale)
    assert out.dtype == dtype and out.shape == q.shape
    expected = _reference(q, keys, values, slots, lengths, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    # positions past a row's length do not matter
    short = lengths <= 250
    keys[:, :, 250:] = 1e4
    values[:, :, 250:] = float("nan")
    torch.testing.assert_close(kernel(q[short].contiguous(), keys, values, slots[short],
                                      lengths[short], scale), out[short])


def _reference_windowed(q, keys, values, slots, starts, lengths, scale, sinks):
    """Per row, as transformers' eager attention computes it: fp32 scores over positions
    [starts[r], lengths[r]) of its slot, softmax with one sink logit per head (dropped)."""
    hkv = keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for r, (s, a, n) in enumerate(zip(slots.tolist(), starts.tolist(), lengths.tolist())):
        k = keys[s, :, a:n].float().repeat_interleave(q.shape[1] // hkv, dim=0)
        v = values[s, :, a:n].float().repeat_interleave(q.shape[1] // hkv, dim=0)
        scores = (q[r].float()[:, None] @ k.transpose(-1, -2))[:, 0] * scale  # [Hq, keys]
        if sinks is not None:
            w = torch.cat([scores, sinks[:, None]], -1).softmax(-1)[:, :-1]
        else:
            w = scores.softmax(-1)
        out[r] = (w[:, None] @ v)[:, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (8, 1, 32)])
def test_sliding_window_starts_and_sinks(isa_kernel, dtype, with_sinks, hq, hkv, d):
    """Rows attend [starts, lengths) (a sliding-window layer) and, with sinks, each head's sink
    logit joins the softmax (gpt-oss), on every path."""
    kernel = isa_kernel
    g = torch.Generator().manual_seed(7 + d)
    keys = torch.randn(5, hkv, 200, d, generator=g).to(dtype)
    values = torch.randn(5, hkv, 200, d, generator=g).to(dtype)
    slots = torch.tensor([0, 3, 3, 3, 1, 4])
    lengths = torch.tensor([1, 100, 101, 102, 200, 17])
    starts = torch.tensor([0, 92, 93, 94, 100, 0])  # a window of 8 on a verify block; none
    sinks = torch.randn(hq, generator=g) * 2 if with_sinks else None
    q = torch.randn(len(slots), hq, d, generator=g).to(dtype)
    out = kernel(q, keys, values, slots, lengths, d ** -0.5, starts, sinks)
    expected = _reference_windowed(q, keys, values, slots, starts, lengths, d ** -0.5, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    # keys before a row's start do not matter
    keys[3, :, :92] = float("nan")
    values[3, :, :92] = float("nan")
    torch.testing.assert_close(kernel(q, keys, values, slots, lengths, d ** -0.5, starts, sinks),
                               out)
    with pytest.raises(RuntimeError, match="start"):
        kernel(q, keys, values, slots, lengths, d ** -0.5, lengths.clone(), sinks)
    with pytest.raises(RuntimeError, match="sinks"):
        kernel(q, keys, values, slots, lengths, d ** -0.5, starts, torch.zeros(hq + 1))


def test_bad_input_is_refused(kernel):
    keys = torch.zeros(2, 1, 8, 16)
    q = torch.zeros(1, 2, 16)
    ok = dict(slots=torch.tensor([1]), lengths=torch.tensor([8]))
    kernel(q, keys, keys, **ok, scale=1.0)
    for bad, match in [(dict(ok, lengths=torch.tensor([0])), "length"),
                       (dict(ok, lengths=torch.tensor([9])), "length"),
                       (dict(ok, slots=torch.tensor([2])), "slot"),
                       (dict(ok, slots=torch.tensor([1], dtype=torch.int32)), "int64")]:
        with pytest.raises(RuntimeError, match=match):
            kernel(q, keys, keys, **bad, scale=1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q.double(), keys.double(), keys.double(), **ok, scale=1.0)
    for hq, hkv in ((3, 2), (2, 0), (18, 2)):
        with pytest.raises(RuntimeError, match="heads"):
            kernel(torch.zeros(1, hq, 16), torch.zeros(2, hkv, 8, 16), torch.zeros(2, hkv, 8, 16),
                   **ok, scale=1.0)


def _greedy_text(runner, drafter, prompts):
    engine = SpecEngine(runner, drafter, [], EngineConfig(
        scheduler="fixed" if drafter is not None else "none", sps_profile="off"))
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=40,
                                                                    temperature=0.0)))
    out = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.mark.parametrize("with_drafter", [False, True])
def test_an_engine_on_the_kernel_decodes_the_text_of_the_pytorch_path(kernel, with_drafter):
    """fp32 greedy, decode steps (target only) and verify blocks (a drafter): token-identical,
    with a prompt longer than the kernel's rows per request (prefilled by SDPA) beside them."""
    model = tiny_target(seed=5)
    drafter = tiny_drafter(model, layer_ids=(1, 3)) if with_drafter else None
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (3, 45, 11, 7)]
    texts = {}
    for attention in ("kernel", "pytorch"):
        runner = TargetRunner(model, [1, 3])
        engine_cfg = EngineConfig(attention=attention)
        runner.use_decode_kernel(engine_cfg.attention == "kernel")
        assert (runner.decode_kernel is not None) == (attention == "kernel")
        texts[attention] = _greedy_text(runner, drafter, prompts)
    assert texts["kernel"] == texts["pytorch"]
    assert all(len(t) == 40 for t in texts["kernel"].values())


def test_where_it_cannot_be_built_the_engine_attends_with_pytorch(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    forget_kernels()
    try:
        with caplog.at_level(logging.WARNING):
            runner = TargetRunner(tiny_target(), [1])
        assert runner.decode_kernel is None
        assert "no C++ compiler" in caplog.text and "PyTorch" in caplog.text
        assert _greedy_text(runner, None, [[5, 9, 11]])["r0"]  # still decodes
    finally:
        forget_kernels()  # the next caller builds (loads) it again


def test_builds_are_kept_per_cpu_and_torch_version(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = build_directory()
    assert directory.parent == tmp_path
    assert directory.name.startswith("dspark_decode_attention_")
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert build_directory() != directory


def test_the_kernel_is_not_used_where_it_does_not_apply(kernel):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    assert not TargetRunner(tiny_target().to(torch.float16), []).use_decode_kernel(True)
    many_heads = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=96, hidden_size=192, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=12, num_key_value_heads=1, head_dim=16)).eval()
    assert not TargetRunner(many_heads, []).use_decode_kernel(True)  # 12 query heads per KV head
    assert TargetRunner(tiny_target(), []).use_decode_kernel(True)


def test_engines_sharing_a_runner_each_attend_as_configured(kernel):
    """Engines built on one set of models share its runner; each engine's passes use its own
    engine.attention, and a stored SPS profile is only reused for the same attention path."""
    from serve.engine.profiling import hardware_fingerprint

    runner = TargetRunner(tiny_target(seed=6), [])
    seen: list[bool] = []
    real = runner.forward_batch

    def spy(*args, **kwargs):
        seen.append(runner.decode_kernel is not None)
        return real(*args, **kwargs)

    runner.forward_batch = spy
    engines = {a: SpecEngine(runner, None, [], EngineConfig(scheduler="none", sps_profile="off",
                                                            attention=a))
               for a in ("pytorch", "kernel")}
    for i, attention in enumerate(("pytorch", "kernel", "pytorch")):
        seen.clear()
        engine = engines[attention]
        engine.add_request(EngineRequest(f"r{i}", [5, 9, 11], SamplingParams(max_tokens=3)))
        while engine.has_unfinished():
            engine.step()
        assert seen and all(used == (attention == "kernel") for used in seen)
        assert hardware_fingerprint(runner)["attention"].split(" ")[0] == attention
