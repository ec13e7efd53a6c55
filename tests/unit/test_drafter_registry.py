"""A new drafter type is one new file plus one registry line (issue 22): a small drafter defined
here, registered once, is configured, trained by the trainer's loss path, saved, loaded and
verified losslessly by the engine, with no other module touched; and every per-type decision of
the built-in types comes from their registered specs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from drafters import registry
from drafters.base import BlockProposal, DrafterBase
from drafters.config import DrafterConfig
from drafters.dspark_options import DSparkOptions
from drafters.loading import build_drafter, load_drafter
from drafters.losses import position_weights
from drafters.sampling import sample_rows
from drafters.spec import DrafterSpec
from tests.tiny import tiny_target

LAYERS = [1, 3]


# ----------------------------------------------------------------------------- the new type
@dataclass
class LastFeatureState:
    """The committed context as this drafter keeps it: the last position's features [B, m*H_t]."""

    features: torch.Tensor | None = None
    length: int = 0


class LastFeatureDrafter(DrafterBase):
    """Slot k's state is embed(anchor) + W g_{p-1} + s_k: the anchor, the target's features of
    the position before it (so its anchors start at 1) and a learned vector per slot."""

    def __init__(self, config, embed_weight, lm_head_weight, draft_vocab=None):
        super().__init__(config, embed_weight, lm_head_weight, draft_vocab)
        h = config.hidden_size
        self.fuse = nn.Linear(config.num_context_layers * config.target_hidden_size, h, bias=False)
        nn.init.zeros_(self.fuse.weight)  # starts as "the anchor again"; training adds the rest
        self.slots = nn.Parameter(torch.zeros(config.block_size, h))

    def _hidden(self, anchor_tokens, features, n):  # int64 [B], [B, m*H_t] -> [B, n, H]
        base = F.embedding(anchor_tokens, self.embed_weight) + self.fuse(features.float())
        return base[:, None] + self.slots[None, :n]

    def forward(self, packed):
        rows = packed.context_offsets[packed.block_sequence_ids()] + packed.anchor_positions - 1
        return self._hidden(packed.anchor_tokens, packed.context_features[rows],
                            self.config.block_size)

    def head_features(self, hidden, prev_tokens):
        return None, None

    def logits_from(self, hidden, features=None):
        return self.draft_head(hidden)

    def draft_logits(self, hidden, prev_tokens):
        return self.draft_head(hidden), None

    def new_draft_state(self):
        return LastFeatureState()

    @torch.no_grad()
    def extend_context(self, state, context_features, positions, next_tokens=None):
        state.features = context_features[:, -1]
        state.length = int(positions[0, -1]) + 1

    @torch.no_grad()
    def propose_block(self, state, anchor_tokens, anchor_positions, num_draft_tokens,
                      temperature, generator=None, top_p=1.0):
        logits = self.draft_head(self._hidden(anchor_tokens, state.features, num_draft_tokens))
        if bool((torch.as_tensor(temperature) <= 0).all()):
            return BlockProposal(self.to_target_ids(logits.argmax(-1)), None, None)
        drawn = [sample_rows(logits[:, k], temperature, top_p, generator, slot=k,
                             target_ids=self.d2t) for k in range(num_draft_tokens)]
        return BlockProposal(self.to_target_ids(torch.stack([t for t, _ in drawn], 1)),
                             self.to_target_probs(torch.stack([p for _, p in drawn], 1)), None)


SPEC = DrafterSpec(name="last_feature", title="LastFeature", model_class=LastFeatureDrafter,
                   objective="ce", min_anchor=1,
                   step_weights=lambda cfg: position_weights(cfg.block_size, cfg.loss_decay))


# ----------------------------------------------------------------------------- the proof
@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(registry, "SPECS", dict(registry.SPECS))  # undone after the test
    return registry.register(SPEC)


def _samples(target, n=4, prompt_len=6, new_tokens=34, seed=0):
    """Cache rows of the target's own greedy continuations (what the generate stage makes)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.randint(2, target.config.vocab_size, (1, prompt_len), generator=g)
            for _ in range(new_tokens):
                nxt = target(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat((ids, nxt), dim=1)
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
            mask = torch.zeros(ids.shape[1], dtype=torch.uint8)
            mask[prompt_len:] = 1
            out.append({"input_ids": ids[0], "loss_mask": mask,
                        "context_hidden": torch.cat([hs[l + 1][0] for l in LAYERS], -1),
                        "last_hidden": hs[-1][0]})
    return out


def test_a_drafter_defined_here_trains_saves_loads_and_verifies_losslessly(registered, tmp_path):
    from pipeline.config import PipelineConfig, TrainConfig
    from pipeline.train.worker import batch_losses
    from serve.engine.decoding import SpeculativeDecoder
    from serve.engine.target_runner import TargetRunner

    # configured like any type: the pipeline's drafter section validates it through the registry
    cfg = PipelineConfig.model_validate({
        "target": {"name_or_path": "tiny"}, "prompts": {"sources": [{"path": "p.jsonl"}]},
        "drafter": {"drafter_type": "last_feature", "block_size": 3, "head_type": "none",
                    "confidence_head": False}})
    assert cfg.drafter.spec is SPEC
    # its options are the base model's (a layer count): DSpark's heads are not asked to be
    # switched off, and asking for one is refused by name
    assert DrafterConfig(drafter_type="last_feature").head_type == "none"
    with pytest.raises(ValueError, match="a LastFeature drafter has no sequential head"):
        DrafterConfig(drafter_type="last_feature", head_type="markov")

    target = tiny_target()
    torch.manual_seed(0)
    bound = cfg.drafter.for_target(target.config, "tiny-qwen3", LAYERS)
    drafter = build_drafter(bound, target.get_input_embeddings().weight,
                            target.get_output_embeddings().weight)
    assert type(drafter) is LastFeatureDrafter

    # trained by the trainer's own loss path: packing by the spec's anchor rule, its objective
    tc = TrainConfig(num_workers=1, micro_batch_size=4, global_batch_size=4, num_anchors=8)
    objective, weights = bound.spec.training_objective(bound)
    assert bound.spec.training_objective(bound, "soft_ce")[0] == "soft_ce"  # train.objective
    torch.testing.assert_close(bound.spec.training_objective(bound, "soft_ce")[1], weights)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    samples, losses = _samples(target), []
    for step in range(8):
        gens = [torch.Generator().manual_seed(step * 10 + i) for i in range(len(samples))]
        out = batch_losses(drafter, samples, tc, objective, weights, torch.device("cpu"), gens)
        assert drafter.pack_blocks(samples, 8, gens).anchor_positions.min() >= 1
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert losses[-1] < losses[0]

    # saved and loaded by its type
    drafter.eval().save_pretrained(tmp_path / "drafter")
    loaded = load_drafter(tmp_path / "drafter", target, "tiny-qwen3")
    assert type(loaded) is LastFeatureDrafter and loaded.config == drafter.config
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)

    # verified by the engine: greedy output identical to the target alone; sampling runs
    dec = SpeculativeDecoder(TargetRunner(target, LAYERS), loaded, eos_token_ids=[])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        prompt = torch.randint(0, target.config.vocab_size, (6,), generator=g).tolist()
        spec = dec.generate(prompt, 16)
        assert spec.tokens == dec.generate(prompt, 16, num_draft_tokens=0).tokens
        assert sum(r.accepted for r in spec.rounds) > 0  # it really speculated
        assert len(dec.generate(prompt, 16, temperature=1.0, seed=3).tokens) == 16


def test_a_format_the_type_has_no_exporter_for_is_refused_by_name(registered, tmp_path,
                                                                   tiny_target_dir):
    from drafters.export import ExportError, export
    from serve.engine.target_loading import load_target

    target = load_target(str(tiny_target_dir))
    cfg = DrafterConfig(drafter_type="last_feature", block_size=2, head_type="none",
                        confidence_head=False).for_target(target.config, str(tiny_target_dir),
                                                          LAYERS)
    build_drafter(cfg, target.get_input_embeddings().weight,
                  target.get_output_embeddings().weight).save_pretrained(tmp_path / "d")
    with pytest.raises(ExportError, match="this one is last_feature"):
        export(tmp_path / "d", tmp_path / "out", "vllm")


def test_registering_a_taken_name_is_refused(registered):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(DrafterSpec(name="dspark", title="X", model_class=LastFeatureDrafter,
                                      objective="ce", step_weights=lambda cfg: None))
    assert registry.drafter_types()[:3] == ("dspark", "dflash", "eagle3")


@pytest.mark.parametrize("name, min_anchor, anchor_slots, objective", [
    ("dspark", 0, 0, "dspark"), ("dflash", 0, 1, "ce"), ("eagle3", 1, 0, "soft_ce")])
def test_the_built_in_specs_hold_each_types_rules(name, min_anchor, anchor_slots, objective):
    spec = registry.get_spec(name)
    assert (spec.min_anchor, spec.anchor_slots, spec.objective) == (min_anchor, anchor_slots,
                                                                    objective)
    cfg = DrafterConfig(drafter_type=name, block_size=4)
    assert cfg.num_block_inputs == 4 + anchor_slots
    with pytest.raises(ValueError, match="drafter_type must be one of 'dspark', 'dflash'"):
        registry.get_spec("medusa")


def test_checkpoints_of_the_previous_layout_load(tmp_path):
    """config.json as transformers' PretrainedConfig wrote it before the registry (flat fields,
    transformers_version, no qk_norm in the oldest): read as it is."""
    import json

    from drafters.config import read_drafter_config

    old = {"block_size": 4, "calibration_temperatures": None, "confidence_head": True,
           "draft_vocab_sha256": None, "draft_vocab_size": 0, "drafter_type": "eagle3",
           "head_dim": 16, "head_type": "none", "hidden_size": 64, "intermediate_size": 128,
           "loss_decay": None, "markov_rank": 16, "max_position_embeddings": 1024,
           "model_type": "dspark_drafter", "num_attention_heads": 4, "num_hidden_layers": 1,
           "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
           "target_hidden_size": 64, "target_layer_ids": [1, 3], "target_name_or_path": "t",
           "target_vocab_size": 96, "transformers_version": "5.24.0", "vocab_size": 96}
    old["confidence_head"] = False
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = read_drafter_config(tmp_path)
    assert (cfg.drafter_type, cfg.num_hidden_layers, cfg.options.num_layers) == ("eagle3", 1, 1)
    assert cfg.qk_norm is False and cfg.loss_decay == 4.0 and cfg.target_layer_ids == [1, 3]
    assert {k: v for k, v in cfg.to_json_dict().items() if v != old.get(k)} == {
        "loss_decay": 4.0, "qk_norm": False}


def test_a_drafter_missing_part_of_the_interface_is_refused_at_registration(registered):
    """A type without propose_block would otherwise be found out mid-evaluation, after training."""

    class NoProposal(DrafterBase):  # everything but propose_block
        forward = LastFeatureDrafter.forward
        head_features = LastFeatureDrafter.head_features
        logits_from = LastFeatureDrafter.logits_from
        new_draft_state = LastFeatureDrafter.new_draft_state
        extend_context = LastFeatureDrafter.extend_context

    with pytest.raises(ValueError, match="does not implement propose_block"):
        registry.register(DrafterSpec(name="no_proposal", title="X", model_class=NoProposal,
                                      objective="ce", step_weights=lambda cfg: None))

    class Half(DrafterBase):  # only the training half
        forward = LastFeatureDrafter.forward
        head_features = LastFeatureDrafter.head_features
        logits_from = LastFeatureDrafter.logits_from

    with pytest.raises(ValueError, match="extend_context, new_draft_state, propose_block"):
        registry.register(DrafterSpec(name="half", title="X", model_class=Half, objective="ce",
                                      step_weights=lambda cfg: None))
    with pytest.raises(ValueError, match="init_from_target"):
        registry.register(DrafterSpec(name="no_init", title="X", model_class=LastFeatureDrafter,
                                      objective="ce", step_weights=lambda cfg: None,
                                      options=DSparkOptions))
    with pytest.raises(ValueError, match="not a drafters.base.DrafterBase"):
        registry.register(DrafterSpec(name="module", title="X", model_class=nn.Linear,
                                      objective="ce", step_weights=lambda cfg: None))
    assert "half" not in registry.drafter_types() and "no_proposal" not in registry.drafter_types()
