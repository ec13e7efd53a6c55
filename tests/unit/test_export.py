"""drafters.export (issue 13): the renamed tensors hold exactly the drafter's numbers in the
engines' conventions (offset d2t, target-indexed Markov W1, the DSpark mask as an embedding row,
the DFlash mask in ``mask_embedding.pt``, layer ids), the configs carry the fields vLLM and
speculators read, and what an engine cannot represent is refused with the reason. Loading by vLLM
itself: tests/interop."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from drafters.export import ExportError, choose_mask_token, export, main
from serve.engine.target_loading import load_target
from tests.tiny import tiny_drafter


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(str(tiny_target_dir))


def _save(drafter, path, target_dir):
    drafter.config.target_name_or_path = str(target_dir)
    drafter.save_pretrained(path)
    return path


def _randomized(drafter):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return drafter


# a 285-token draft vocabulary of target ids, in a frequency-like (not ascending) order
VOCAB = list(range(5, 2000, 7))[::-1]
VOCAB = VOCAB[1::2] + VOCAB[::2]
ASCENDING = sorted(VOCAB)


def test_dspark_vllm_export_holds_the_drafter_in_vllm_conventions(tmp_path, target,
                                                                  tiny_target_dir):
    drafter = _randomized(tiny_drafter(target, layer_ids=(1, 3), block_size=4,
                                       draft_vocab=VOCAB))
    src = _save(drafter, tmp_path / "src", tiny_target_dir)
    summary = export(src, tmp_path / "out", "vllm")
    mask = summary["mask_token_id"]
    t = load_file(tmp_path / "out" / "model.safetensors")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    sd = drafter.state_dict()
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["target_layer_ids"] == [1, 3] and cfg["block_size"] == 4
    assert cfg["draft_vocab_size"] == len(VOCAB) and cfg["vocab_size"] == target.config.vocab_size
    assert cfg["mask_token_id"] == mask == cfg["dflash_config"]["mask_token_id"]
    assert cfg["sample_from_anchor"] and cfg["enable_confidence_head"]
    # d2t: offsets (target = draft + d2t[draft]) over the vocabulary in ascending target ids
    assert (torch.arange(len(VOCAB)) + t["d2t"]).tolist() == ASCENDING
    # Markov W1 by target id: a draft token's row is its draft row, any other id the outside row
    w1 = sd["head.w1.weight"]
    assert torch.equal(t["markov_head.markov_w1.weight"][VOCAB[10]], w1[10])
    assert torch.equal(t["markov_head.markov_w1.weight"][6], w1[len(VOCAB)])
    assert t["markov_head.markov_w1.weight"].shape == (target.config.vocab_size, 16)
    # W2 and the LM head rows follow the exported order: exported row j is target id ASCENDING[j]
    j = ASCENDING.index(VOCAB[7])
    assert torch.equal(t["markov_head.markov_w2.weight"][j], sd["head.w2.weight"][7])
    # the mask is one embedding row; every other row is the target's
    emb = target.get_input_embeddings().weight
    assert torch.equal(t["embed_tokens.weight"][mask], sd["mask_embedding"])
    others = torch.arange(emb.shape[0]) != mask
    assert torch.equal(t["embed_tokens.weight"][others], emb[others])
    assert torch.equal(t["lm_head.weight"], target.get_output_embeddings().weight[ASCENDING])
    assert torch.equal(t["fc.weight"], sd["context_proj.weight"])
    assert torch.equal(t["hidden_norm.weight"], sd["context_norm.weight"])
    assert torch.equal(t["confidence_head.proj.weight"], sd["confidence.proj.weight"])
    assert torch.equal(t["layers.0.self_attn.q_norm.weight"], sd["layers.0.self_attn.q_norm.weight"])
    assert "mask_embedding" not in t and not any(k.startswith("head.") for k in t)
    assert "calibration does not carry over" in (tmp_path / "out" / "README.md").read_text()


def test_speculators_config(tmp_path, target, tiny_target_dir):
    src = _save(tiny_drafter(target, layer_ids=(1, 3), draft_vocab=VOCAB), tmp_path / "src",
                tiny_target_dir)
    export(src, tmp_path / "out", "speculators", dtype="bfloat16")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "dspark"
    assert cfg["aux_hidden_state_layer_ids"] == [2, 4]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dspark" and spec["verifier"]["name_or_path"] == str(tiny_target_dir)
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["transformer_layer_config"]["model_type"] == "qwen3"
    t = load_file(tmp_path / "out" / "model.safetensors")
    assert t["fc.weight"].dtype == torch.bfloat16
    assert t["confidence_head.proj.weight"].dtype == torch.float32  # vLLM keeps it in fp32


def test_dflash_vllm_export_holds_the_drafter_in_vllm_conventions(tmp_path, target,
                                                                  tiny_target_dir):
    drafter = _randomized(tiny_drafter(target, layer_ids=(1, 3), block_size=4,
                                       drafter_type="dflash", draft_vocab=VOCAB))
    src = _save(drafter, tmp_path / "src", tiny_target_dir)
    mask = export(src, tmp_path / "out", "vllm")["mask_token_id"]
    t = load_file(tmp_path / "out" / "model.safetensors")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    sd = drafter.state_dict()
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": mask, "target_layer_ids": [1, 3],
                                    "causal": False}
    assert cfg["block_size"] == 5  # anchor + 4 masks, as z-lab's and speculators' DFlash count
    assert cfg["draft_vocab_size"] == len(VOCAB) and cfg["vocab_size"] == target.config.vocab_size
    # the learned mask vector travels in vLLM's mask_embedding.pt; the embedding is the target's
    file = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)
    assert file["mask_token_id"] == mask and torch.equal(file["embedding"], sd["mask_embedding"])
    assert "embed_tokens.weight" not in t and "mask_embedding" not in t
    assert (torch.arange(len(VOCAB)) + t["d2t"]).tolist() == ASCENDING
    assert torch.equal(t["lm_head.weight"], target.get_output_embeddings().weight[ASCENDING])
    assert torch.equal(t["fc.weight"], sd["context_proj.weight"])
    assert torch.equal(t["hidden_norm.weight"], sd["context_norm.weight"])
    assert torch.equal(t["norm.weight"], sd["norm.weight"])
    k_norm = "layers.0.self_attn.k_norm.weight"
    assert torch.equal(t[k_norm], sd[k_norm])
    assert set(t) == {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t"} | {
        k for k in sd if k.startswith("layers.")}
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "mask_embedding.pt" in readme and '"method": "dflash"' in readme


def test_dflash_speculators_config(tmp_path, target, tiny_target_dir):
    src = _save(tiny_drafter(target, layer_ids=(1, 3), block_size=4, drafter_type="dflash"),
                tmp_path / "src", tiny_target_dir)
    mask = export(src, tmp_path / "out", "speculators", dtype="bfloat16")["mask_token_id"]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == [2, 4] and cfg["mask_token_id"] == mask
    # vLLM's update_dflash: causal = not sliding_window_non_causal; no anchor sampling
    assert cfg["sliding_window_non_causal"] and not cfg["sample_from_anchor"]
    assert cfg["block_size"] == 5 and cfg["draft_vocab_size"] == target.config.vocab_size
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["proposal_methods"][0]["speculative_tokens"] == 4
    t = load_file(tmp_path / "out" / "model.safetensors")
    assert t["fc.weight"].dtype == torch.bfloat16 and "d2t" not in t
    assert torch.equal(t["lm_head.weight"].float(),
                       target.get_output_embeddings().weight.bfloat16().float())
    file = torch.load(tmp_path / "out" / "mask_embedding.pt", weights_only=True)
    assert file["embedding"].dtype == torch.bfloat16


def test_eagle3_export_is_the_specforge_layout(tmp_path, target, tiny_target_dir):
    drafter = _randomized(tiny_drafter(target, layer_ids=(1, 3), drafter_type="eagle3",
                                       draft_vocab=VOCAB))
    src = _save(drafter, tmp_path / "src", tiny_target_dir)
    export(src, tmp_path / "out", "eagle3")
    t = load_file(tmp_path / "out" / "model.safetensors")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    sd = drafter.state_dict()
    assert cfg["architectures"] == ["Eagle3Qwen3ForCausalLM"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4] and cfg["num_aux_hidden_states"] == 2
    assert torch.equal(t["midlayer.hidden_norm.weight"], sd["layers.0.hidden_norm.weight"])
    assert t["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64  # [embeds; hidden]
    assert t["t2d"].sum() == len(VOCAB) and t["t2d"][VOCAB].all()
    assert (torch.arange(len(VOCAB)) + t["d2t"]).tolist() == ASCENDING
    assert torch.equal(t["lm_head.weight"], target.get_output_embeddings().weight[ASCENDING])
    assert not any(k.startswith("layers.") for k in t)


@pytest.mark.parametrize("kwargs, fmt, needle", [
    ({"head_type": "rnn"}, "vllm", "Markov head only"),
    ({}, "eagle3", "exports Eagle3 drafters"),
    ({"drafter_type": "dflash"}, "eagle3", "this one is dflash"),
    ({"layer_ids": (1, 5)}, "vllm", "last layer"),
    ({"layer_ids": (1, 5), "drafter_type": "dflash"}, "speculators", "last layer"),
    ({"drafter_type": "eagle3", "num_layers": 2}, "eagle3", "one decoder layer"),
])
def test_what_an_engine_cannot_represent_is_refused(tmp_path, target, tiny_target_dir, kwargs,
                                                    fmt, needle):
    src = _save(tiny_drafter(target, **{"layer_ids": (1, 3), **kwargs}), tmp_path / "src",
                tiny_target_dir)
    with pytest.raises(ExportError, match=needle):
        export(src, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("drafter_type, fmt", [("dspark", "vllm"), ("dflash", "vllm"),
                                               ("dflash", "speculators")])
def test_layers_without_qk_norm_are_refused(tmp_path, target, tiny_target_dir, drafter_type,
                                            fmt):
    """vLLM's DSpark and DFlash layers always normalise q and k (DFlashQwen3Attention)."""
    from drafters import DSparkDrafter

    cfg = tiny_drafter(target, drafter_type=drafter_type).config
    cfg.qk_norm = False  # a Llama-style target's drafter
    drafter = DSparkDrafter(cfg, target.get_input_embeddings().weight,
                            target.get_output_embeddings().weight)
    src = _save(drafter, tmp_path / "src", tiny_target_dir)
    kind = "DFlash" if drafter_type == "dflash" else "DSpark"
    with pytest.raises(ExportError, match=f"vLLM's {kind} layers are Qwen3 layers with q/k norms"):
        export(src, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_mask_token_choice():
    assert choose_mask_token(151_936, 151_669, [151_643, 151_645], [151_645]) == 151_669
    assert choose_mask_token(49_152, 49_152, [0, 1, 2], [2]) == 1
    with pytest.raises(ExportError, match="--mask-token-id"):
        choose_mask_token(96, None, [], [1])


def test_cli_names_the_problem(tmp_path, capsys, target, tiny_target_dir):
    assert main(["--format", "vllm", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "config.json" in capsys.readouterr().err
    src = _save(tiny_drafter(target, layer_ids=(1, 3)), tmp_path / "src", tiny_target_dir)
    assert main(["--format", "vllm", str(src), str(tmp_path / "out"), "--target",
                 str(tmp_path / "no_target")]) == 1
    assert "cannot load the target" in capsys.readouterr().err
    assert main(["--format", "vllm", str(src), str(tmp_path / "out"),
                 "--mask-token-id", "10000000"]) == 1
    assert "outside the vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_full_vocabulary_export_ships_the_lm_head_and_never_overwrites_a_drafter(
        tmp_path, target, tiny_target_dir):
    src = _save(tiny_drafter(target, layer_ids=(1, 3)), tmp_path / "src", tiny_target_dir)
    export(src, tmp_path / "out", "vllm")
    t = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(t["lm_head.weight"], target.get_output_embeddings().weight)
    assert "d2t" not in t
    before = (src / "model.safetensors").read_bytes()
    for dst in (src, tmp_path / "other_drafter"):
        if dst != src:
            _save(tiny_drafter(target, layer_ids=(1, 3)), dst, tiny_target_dir)
        with pytest.raises(ExportError, match="holds a dspark-ray drafter"):
            export(src, dst, "vllm")
    assert (src / "model.safetensors").read_bytes() == before
    export(src, tmp_path / "out", "speculators")  # a previous export is replaced whole
    assert "speculators_model_type" in (tmp_path / "out" / "config.json").read_text()
    assert not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_exports_state_the_drafters_attention_window(tmp_path, target, tiny_target_dir, kind,
                                                     fmt):
    """A windowed drafter's layers are sliding layers in the exported config, with the window
    vLLM's DFlash/DSpark layers read, and stay non-causal (vLLM makes a sliding layer causal
    unless dflash_config says otherwise); a full-attention drafter says full attention."""
    extra = {"drafter_type": "dflash"} if kind == "dflash" else {}
    for window, types in ((12, ["sliding_attention"]), (None, ["full_attention"])):
        drafter = tiny_drafter(target, layer_ids=(1, 3), sliding_window=window, **extra)
        out = tmp_path / f"{window}"
        export(_save(drafter, out / "src", tiny_target_dir), out / "x", fmt)
        cfg = json.loads((out / "x" / "config.json").read_text())
        layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
        assert layer["layer_types"] == types and layer["sliding_window"] == window
        assert layer["use_sliding_window"] == (window is not None)
        if fmt == "vllm":
            assert cfg["dflash_config"]["causal"] is False
        else:  # vLLM's update_dflash: causal = not sliding_window_non_causal (DSpark too)
            assert cfg["sliding_window_non_causal"] is True
