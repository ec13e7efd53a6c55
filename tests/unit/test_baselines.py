"""Plain transformers ``generate`` as the speed baseline (pipeline/baselines.py): greedy output equals
the cache-free reference, stops at the first shared EOS id, and prompt lookup does not change it."""

from __future__ import annotations

from pipeline.baselines import hf_generate
from tests.unit.helpers import greedy_reference, permuted_target


def test_plain_generate_greedy_matches_reference_and_stops_at_eos():
    target = permuted_target()
    prompt = list(range(10, 20))
    ref = greedy_reference(target, prompt, 20)
    out = hf_generate(target, prompt, 20, 0.0, 0, eos_token_ids=[10**6], pad_token_id=0)
    assert out.tokens == ref and out.seconds > 0
    eos = ref[5]
    stopped = hf_generate(target, prompt, 20, 0.0, 0, eos_token_ids=[10**6, eos], pad_token_id=0)
    assert stopped.tokens == ref[:ref.index(eos) + 1]
    looked_up = hf_generate(target, prompt, 20, 0.0, 0, [10**6], 0, prompt_lookup_num_tokens=4)
    assert looked_up.tokens == ref


def test_plain_generate_sampling_is_seeded():
    target = permuted_target()
    a = hf_generate(target, [1, 2, 3], 12, 1.0, 7, [10**6], 0).tokens
    b = hf_generate(target, [1, 2, 3], 12, 1.0, 7, [10**6], 0).tokens
    assert a == b and len(a) == 12
