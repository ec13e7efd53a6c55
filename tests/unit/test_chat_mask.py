"""Loss mask from the real SmolLM2 chat template: assistant tokens only, derived turn by turn."""

import pytest

from serve.engine.chat import ChatTemplateError, render_prompt_ids, tokenize_conversation

KW = {"enable_thinking": False}


def test_mask_covers_exactly_the_assistant_turns(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "It is 6."}]
    out = tokenize_conversation(tok, msgs, KW, max_length=4096)
    ids, mask = out.input_ids, out.loss_mask
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    assert len(spans) == 2
    texts = [tok.decode(ids[a:b]) for a, b in spans]
    assert texts == ["It is 4.<|im_end|>", "It is 6.<|im_end|>"]
    # the prefix before the first span is exactly the rendered generation prompt
    assert ids[:spans[0][0]] == render_prompt_ids(tok, msgs[:1], KW)


def test_truncation_and_degenerate_masks(smollm2_tokenizer):
    tok = smollm2_tokenizer
    msgs = [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ChatTemplateError, match="all zeros"):
        tokenize_conversation(tok, msgs, KW, max_length=20)
    with pytest.raises(ChatTemplateError, match="no assistant turn"):
        tokenize_conversation(tok, msgs[:1], KW, max_length=100)


def test_template_that_cannot_produce_a_mask_raises(smollm2_tokenizer):
    tok = smollm2_tokenizer
    saved = tok.chat_template
    # a template whose generation prompt differs from how the finished turn is rendered
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                         "assistant: {% endif %}")
    try:
        with pytest.raises(ChatTemplateError, match="not a token prefix"):
            tokenize_conversation(tok, [{"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello there"}], KW, 100)
    finally:
        tok.chat_template = saved


# A Qwen3-style template: an assistant turn that is the last message (and the generation prompt,
# with thinking off) carries an empty think block; earlier assistant turns are rendered without it.
QWEN3_STYLE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and loop.last -%}"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m.content }}<|im_end|>\n"
    "{%- else -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
    "{%- endif -%}")


def test_qwen3_style_template_supervises_every_turn_as_serving_renders_it(smollm2_tokenizer):
    """The whole-conversation render differs from what serving saw for turn 1 (no think block in
    history), so each assistant turn becomes a sample whose prompt is exactly the serving prompt;
    no multi-turn conversation is dropped."""
    import copy

    from serve.engine.chat import tokenize_conversation_samples

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN3_STYLE
    msgs = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "It is 6."}]
    with pytest.raises(ChatTemplateError, match="inconsistently"):
        tokenize_conversation(tok, msgs, KW, max_length=4096)
    samples = tokenize_conversation_samples(tok, msgs, KW, max_length=4096)
    assert len(samples) == 2
    for sample, turn, answer in zip(samples, (1, 3), ("It is 4.", "It is 6.")):
        prompt = render_prompt_ids(tok, msgs[:turn], KW)
        start = sample.loss_mask.index(1)
        assert sample.input_ids[:start] == prompt  # what serving feeds the target
        supervised = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
        assert tok.decode(supervised) == answer + "<|im_end|>"
    # a consistent template still gives one sample for the whole conversation
    assert len(tokenize_conversation_samples(smollm2_tokenizer, msgs, KW, 4096)) == 1
