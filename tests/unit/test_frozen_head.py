"""Training workers read only the target tensors they need (embedding, LM head, final norm, the
top decoder layers) from its safetensors files, identical to the whole-model load."""

from __future__ import annotations

import pytest
import torch

from drafters.target_weights import _load_frozen_head_whole, load_frozen_head


@pytest.mark.parametrize("top_layers", [0, 2])
def test_sliced_frozen_head_equals_the_whole_model_load(tiny_target_dir, top_layers):
    sliced = load_frozen_head(str(tiny_target_dir), top_layers)
    whole = _load_frozen_head_whole(str(tiny_target_dir), top_layers)
    assert sliced[0].to_dict() == whole[0].to_dict()
    for a, b in zip(sliced[1:3], whole[1:3]):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    if top_layers:
        (layers_a, norm_a), (layers_b, norm_b) = sliced[3], whole[3]
        assert len(layers_a) == len(layers_b) == top_layers
        for la, lb in zip(layers_a, layers_b):
            lb = {k: v for k, v in lb.items() if not k.endswith("inv_freq")}
            assert la.keys() == lb.keys()
            assert all(torch.equal(la[k], lb[k]) for k in la)
        assert norm_a.keys() == norm_b.keys() and all(torch.equal(norm_a[k], norm_b[k])
                                                       for k in norm_a)


def test_a_checkpoint_without_safetensors_falls_back_to_the_whole_load(tmp_path, tiny_target_dir):
    import shutil

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir))
    model.save_pretrained(tmp_path, safe_serialization=False)  # pytorch_model.bin only
    shutil.copy(tiny_target_dir / "config.json", tmp_path / "config.json")
    cfg, emb, head = load_frozen_head(str(tmp_path))
    assert torch.equal(emb, model.get_input_embeddings().weight)
