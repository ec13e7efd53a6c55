"""Draft vocabulary (drafters/draft_vocab.py; FR-Spec / EAGLE-3 draft_vocab_size) and the chunked
drafter losses (drafters/losses.py).

- decoding stays exactly lossless when the drafter predicts in a subset and the target puts mass
  outside it (greedy token identity; chi-square of sampled output against exact target-only
  probabilities);
- the draft-to-target map survives save/load, and a mismatched or malformed one is rejected;
- the losses treat target mass outside the subset as rejected mass (hand-computed example);
- chunked losses and their gradients equal the one-chunk (dense) computation on the tiny model;
- the cache's supervised-token counts give the frequency ranking and coverage in the manifest.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.draft_vocab import coverage, fingerprint, frequency_ranking, target_to_draft
from drafters.losses import chunked_drafter_losses, drafter_losses, position_weights
from drafters.base import WEIGHTS_NAME
from drafters.dspark import DSparkDrafter
from serve.engine.decoding import SpeculativeDecoder
from serve.engine.target_runner import TargetKV, TargetRunner
from tests.tiny import tiny_drafter, tiny_target
from tests.unit.helpers import greedy_reference, permuted_target, randomize_heads
from tests.unit.test_speculative_lossless import _exact_first_tokens, _pooled_chisquare

SUBSET = [0, 2, 3, 5, 8, 11]  # 6 of 12 target tokens


# ----------------------------------------------------------------------------- ranking
def test_frequency_ranking_and_coverage():
    counts = {7: 5, 2: 9, 4: 5, 1: 0}
    ranking = frequency_ranking(counts, 10)
    assert ranking[:3] == [2, 4, 7]  # by count, ties by id
    assert sorted(ranking) == list(range(10))  # unseen ids follow in ascending order
    assert coverage(counts, [2]) == pytest.approx(9 / 19)
    assert coverage(counts, ranking[:3]) == 1.0
    with pytest.raises(ValueError, match="outside the vocabulary"):
        frequency_ranking({10: 1}, 10)
    t2d = target_to_draft(torch.tensor([4, 1]), 5)
    assert t2d.tolist() == [2, 1, 2, 2, 0]


def test_cache_counts_supervised_tokens_into_the_manifest():
    from pipeline.cache.format import build_manifest
    from pipeline.cache.writer import supervised_token_counts

    rec = lambda ids, mask: {"input_ids": np.asarray(ids, "<i4").tobytes(),
                             "loss_mask": np.asarray(mask, np.uint8).tobytes()}
    counts = supervised_token_counts([rec([1, 5, 5, 9], [0, 1, 1, 1]), rec([9, 5], [1, 0])])
    assert counts == {"5": 2, "9": 2}
    shard = lambda c: {"rows": 1, "tokens": 4, "supervised_tokens": 3, "file": "x",
                       "supervised_token_counts": c}
    manifest = build_manifest(target="t", revision=None, layer_ids=[1], hidden_size=4,
                              vocab_size=2048, template_sha256="", template_kwargs={},
                              max_length=8, splits={"train": [shard(counts)],
                                                    "heldout": [shard({"5": 1, "1500": 3})]})
    assert manifest["splits"]["train"]["token_frequency"] == [[5, 2], [9, 2]]
    assert "supervised_token_counts" not in manifest["splits"]["train"]["shards"][0]
    assert manifest["draft_vocab_coverage"]["1024"] == {"train": 1.0, "heldout": 0.25}


# ----------------------------------------------------------------------------- losslessness
@pytest.fixture(scope="module")
def subset_setup():
    """12-token target (flattened so several tokens have mass) and a drafter over 6 of them with
    random head weights: the target keeps mass outside the subset."""
    target = tiny_target(vocab_size=12, num_layers=2, seed=0)
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(0.5)
    d = randomize_heads(tiny_drafter(target, layer_ids=(0, 1), block_size=4, draft_vocab=SUBSET),
                        seed=1, scale=1.0)
    return target, d


def test_sampled_output_with_draft_vocab_matches_target(subset_setup):
    target, d = subset_setup
    v = target.config.vocab_size
    prompt = [3, 7, 2, 9, 5]
    exact = _exact_first_tokens(target, prompt)
    outside = [t for t in range(v) if t not in SUBSET]
    assert exact.sum(axis=(1, 2))[outside].sum() > 0.2  # real mass outside the subset
    dec = SpeculativeDecoder(TargetRunner(target, [0, 1]), d, eos_token_ids=[])
    counts = np.zeros((v, v, v))
    drafted = accepted = 0
    for seed in range(2400):
        res = dec.generate(prompt, 4, temperature=1.0, seed=seed)
        t1, t2, t3 = res.tokens[:3]
        counts[t1, t2, t3] += 1
        drafted += res.rounds[0].drafted
        accepted += res.rounds[0].accepted
    assert 0.1 * drafted < accepted < 0.9 * drafted
    assert counts.sum(axis=(0, 2))[outside].sum() > 0  # tokens outside still come out
    for observed, expected in ((counts.sum(2), exact.sum(2)), (counts, exact)):
        p = _pooled_chisquare(observed, expected)
        assert p > 1e-3, f"speculative output differs from the target's distribution: p = {p:.2e}"


def test_proposals_stay_in_the_subset(subset_setup):
    target, d = subset_setup
    runner = TargetRunner(target, [0, 1])
    kv = TargetKV()
    out = runner.forward_batch([kv], [[3, 7, 2, 9, 5]], with_features=True)[0]
    state = d.new_draft_state()
    d.extend_context(state, out.features[None], torch.arange(5)[None])
    g = torch.Generator().manual_seed(0)
    prop = d.propose_block(state, torch.tensor([5]), torch.tensor([5]), 4, 1.0, [g])
    assert set(prop.tokens.flatten().tolist()) <= set(SUBSET)
    assert prop.probs.shape == (1, 4, 12)
    outside = [t for t in range(12) if t not in SUBSET]
    assert float(prop.probs[..., outside].abs().sum()) == 0.0
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(1, 4))
    assert kv.length == 0  # the probe forward committed nothing


def test_greedy_with_draft_vocab_is_token_identical():
    target = permuted_target()
    v = target.config.vocab_size
    ref_prompt = list(range(10, 20))
    ref = greedy_reference(target, ref_prompt, 40)
    ranked = sorted(set(ref)) + [t for t in range(v) if t not in set(ref)]
    for subset in (ranked[: len(set(ref)) // 2], ranked[:48]):  # half the output tokens / most
        d = randomize_heads(tiny_drafter(target, layer_ids=(1, 3), draft_vocab=subset), seed=2)
        res = SpeculativeDecoder(TargetRunner(target, [1, 3]), d, []).generate(ref_prompt, 40)
        assert res.tokens == ref


# ----------------------------------------------------------------------------- checkpoints
def test_draft_vocab_survives_save_and_load(subset_setup, tmp_path):
    target, d = subset_setup
    d.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 6 and cfg["draft_vocab_sha256"] == fingerprint(SUBSET)
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    loaded = DSparkDrafter.from_pretrained(tmp_path, emb, head)
    assert loaded.d2t.tolist() == SUBSET
    torch.testing.assert_close(loaded.draft_head_weight, head[SUBSET])
    assert loaded.t2d[SUBSET].tolist() == list(range(6)) and int(loaded.t2d[1]) == 6
    for name, p in d.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], p)


def test_mismatched_draft_vocab_is_rejected(subset_setup, tmp_path):
    target, d = subset_setup
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    d.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / WEIGHTS_NAME))
    weights["d2t"] = torch.tensor([0, 2, 3, 5, 8, 10])  # another subset than the one trained
    save_file(weights, str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="draft_vocab_sha256"):
        DSparkDrafter.from_pretrained(tmp_path, emb, head)
    weights["d2t"] = torch.tensor([0, 2, 3, 5, 8, 8])
    save_file(weights, str(tmp_path / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="repeats"):
        DSparkDrafter.from_pretrained(tmp_path, emb, head)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        tiny_drafter(target, layer_ids=(0, 1), draft_vocab=[0, 12])


# ----------------------------------------------------------------------------- losses
def test_loss_counts_target_mass_outside_the_subset_as_rejected():
    """V = 3, subset {0, 1}: p_t = [1/2, 1/4, 1/4], draft logits [0, 0] -> p_d = [1/2, 1/2, (0)].
    L1 = 0 + 1/4 + 1/4 (outside) = 1/2, accept_rate@1 = 1 - 1/4 = 3/4. Label 2 is outside the
    subset: it has no CE row; label 1 has CE ln 2."""
    draft = torch.zeros(2, 1, 2)
    target = torch.tensor([[math.log(2), 0.0, 0.0]]).expand(2, 3)[:, None]
    labels = torch.tensor([[2], [1]])
    valid = torch.ones(2, 1, dtype=torch.bool)
    out = drafter_losses(draft, target, labels, valid, torch.ones(1),
                         draft_vocab=torch.tensor([0, 1]))
    assert float(out["tv"]) == pytest.approx(0.5, abs=1e-6)
    assert out["accept_rate"].tolist() == pytest.approx([0.75], abs=1e-6)
    assert float(out["ce"]) == pytest.approx(math.log(2), abs=1e-6)  # only the in-subset row
    assert float(out["draft_vocab_coverage"]) == 0.5


@pytest.mark.parametrize("objective", ["dspark", "ce", "soft_ce"])
@pytest.mark.parametrize("subset", [None, SUBSET])
def test_chunked_losses_and_gradients_equal_dense(objective, subset):
    target = tiny_target(vocab_size=12, num_layers=2, seed=0)
    d = randomize_heads(tiny_drafter(target, layer_ids=(0, 1), block_size=4, draft_vocab=subset),
                        seed=3, scale=1.0)
    g = torch.Generator().manual_seed(0)
    n, k, h = 5, 4, target.config.hidden_size
    hidden0 = torch.randn(n, k, h, generator=g)
    prev = torch.randint(0, 12, (n, k), generator=g)
    labels = torch.randint(0, 12, (n, k), generator=g)
    valid = torch.arange(k)[None, :] < torch.tensor([4, 2, 3, 0, 1])[:, None]
    target_hidden = torch.randn(n, k, h, generator=g)
    head_w = d.lm_head_weight
    weights = position_weights(k, 2.0)
    d2t = None if subset is None else torch.tensor(subset)

    def run(chunk_rows, recompute=None):
        d.zero_grad()
        hidden = hidden0.clone().requires_grad_(True)
        feat, conf = d.head_features(hidden, prev)
        if chunk_rows is None:
            logits, _ = d.draft_logits(hidden, prev)
            out = drafter_losses(logits, target_hidden @ head_w.T, labels, valid, weights, conf,
                                 objective=objective, draft_vocab=d2t)
        else:
            h_rows, f_rows, t_rows = hidden[valid], feat[valid], target_hidden[valid]
            out = chunked_drafter_losses(lambda i: d.logits_from(h_rows[i], f_rows[i]),
                                         lambda i: t_rows[i] @ head_w.T, labels, valid, weights,
                                         conf, objective=objective, draft_vocab=d2t,
                                         chunk_rows=chunk_rows, recompute=recompute,
                                         target_slice_rows=2)
        out["loss"].backward()
        grads = {"hidden": hidden.grad.clone(), "w2": d.head.w2.weight.grad.clone(),
                 "w1": d.head.w1.weight.grad.clone()}
        return out, grads

    dense, dense_grads = run(None)
    assert dense["draft_vocab_coverage"] <= 1.0
    # each chunk size with the default recomputation policy, kept and recomputed
    for chunk_rows, recompute in ((1, None), (3, None), (100, None), (3, True), (3, False)):
        out, grads = run(chunk_rows, recompute)
        for key in ("loss", "ce", "tv", "conf", "soft_ce", "tau", "accept_rate"):
            torch.testing.assert_close(out[key], dense[key], rtol=1e-5, atol=1e-6)
        for key, grad in dense_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6)
            assert float(grad.abs().sum()) > 0 or key != "hidden"


def test_select_draft_vocab_from_the_manifest():
    from pipeline.train.driver import select_draft_vocab

    manifest = {"target": {"vocab_size": 10},
                "splits": {"train": {"token_frequency": [[7, 5], [2, 3]]},
                           "heldout": {"token_frequency": [[2, 1], [9, 1]]}}}
    ids, report = select_draft_vocab(manifest, 3)
    assert ids == [7, 2, 0]
    assert report == {"draft_vocab_size": 3, "source": "the cache's supervised-token ranking",
                      "coverage": {"train": 1.0, "heldout": 0.5}}
    assert select_draft_vocab(manifest, 0) == (None, {})
    with pytest.raises(ValueError, match="exceeds the target vocabulary"):
        select_draft_vocab(manifest, 11)
    del manifest["splits"]["train"]["token_frequency"]
    with pytest.raises(ValueError, match="--force cache"):
        select_draft_vocab(manifest, 3)


def test_a_run_started_from_a_drafter_keeps_that_drafters_vocabulary(tmp_path):
    """train.init_from with a draft vocabulary: the driver takes the checkpoint's own d2t (its
    heads are indexed by it), not the cache's ranking; the drafter built from it, loaded with the
    checkpoint's weights and saved, loads again (the config's fingerprint matches its map). With
    the cache's ranking instead, the saved config named one vocabulary and the weights another."""
    from drafters.config import DrafterConfig, DrafterCheckpointError
    from drafters.loading import build_drafter, checkpoint_draft_vocab
    from pipeline.train.driver import select_draft_vocab
    from pipeline.train.worker import init_weights

    target = tiny_target()
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    vocab = target.config.vocab_size
    cfg = DrafterConfig(num_layers=1, block_size=4, markov_rank=16, draft_vocab_size=8)

    def drafter(d2t):
        return build_drafter(cfg.for_target(target.config, "t", [1, 3]), emb, head, d2t)

    released = list(range(vocab - 1, vocab - 9, -1))  # not what the cache below ranks first
    drafter(released).save_pretrained(tmp_path / "released")
    assert checkpoint_draft_vocab(tmp_path / "released") == released
    manifest = {"target": {"vocab_size": vocab},
                "splits": {"train": {"token_frequency": [[1, 9], [released[0], 1]]},
                           "heldout": {"token_frequency": [[released[1], 2]]}}}
    ids, report = select_draft_vocab(manifest, 8, str(tmp_path / "released"))
    assert ids == released and report["source"].startswith("train.init_from")
    assert report["coverage"] == {"train": 0.1, "heldout": 1.0}
    model = drafter(ids)
    init_weights(model, str(tmp_path / "released"))
    model.save_pretrained(tmp_path / "tuned")
    loaded = DSparkDrafter.from_pretrained(tmp_path / "tuned", emb, head)
    assert loaded.d2t.tolist() == released
    with pytest.raises(ValueError, match=r"draft vocabulary of 8 .*draft_vocab_size is 4"):
        select_draft_vocab(manifest, 4, str(tmp_path / "released"))
    with pytest.raises(ValueError, match=r"draft vocabulary of 8 .*draft_vocab_size is 0"):
        select_draft_vocab(manifest, 0, str(tmp_path / "released"))  # named before any worker
    with pytest.raises(ValueError, match="not a URL"):
        select_draft_vocab(manifest, 8, "s3://bucket/released")
    with pytest.raises(ValueError, match="draft_vocab_size: 8 != 4"):
        init_weights(build_drafter(cfg.model_copy(update={"draft_vocab_size": 4}).for_target(
            target.config, "t", [1, 3]), emb, head, released[:4]), str(tmp_path / "released"))
    weights = load_file(str(tmp_path / "released" / WEIGHTS_NAME))
    weights["d2t"] = weights["d2t"].flip(0)
    save_file(weights, str(tmp_path / "released" / WEIGHTS_NAME))
    with pytest.raises(DrafterCheckpointError, match="draft_vocab_sha256"):
        checkpoint_draft_vocab(tmp_path / "released")
