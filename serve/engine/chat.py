"""Chat-template rendering and the assistant-token loss mask (SPEC 1.3).

Many chat templates (SmolLM2's and Qwen's among them) have no ``{% generation %}`` markers, so the
assistant spans are derived by rendering turn by turn: the span of assistant turn i starts where the
render of messages[:i] with the generation prompt ends and stops where the render of messages[:i+1]
ends, trimmed after its end-of-turn token. When every partial render is a token prefix of the full
render, one sample supervises every assistant turn. Some templates render history differently
from the turn being generated (Qwen3 drops the think block of earlier assistant turns), so the
full render is not what serving saw when it produced turn i: then each assistant turn becomes its
own sample, its earlier turns as context, rendered exactly as serving renders a prompt
(:func:`tokenize_conversation_samples`).
"""

from __future__ import annotations

from dataclasses import dataclass


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot produce an assistant loss mask for a conversation."""


@dataclass
class TokenizedConversation:
    """input_ids: token ids [T]; loss_mask: 0/1 per token [T] (1 on assistant tokens)."""

    input_ids: list[int]
    loss_mask: list[int]

    @property
    def num_supervised(self) -> int:
        return sum(self.loss_mask)


def render_prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict,
                      add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's own chat template."""
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(tokenizer, messages: list[dict], template_kwargs: dict,
                          max_length: int) -> TokenizedConversation:
    """Render a whole conversation and mark its assistant tokens.

    Args:
        messages: ``[{"role", "content"}, ...]`` with at least one assistant turn.
        template_kwargs: extra template variables (e.g. ``enable_thinking: False``), identical to
            the ones used to generate the answers and to serve.
        max_length: truncate to this many tokens (SPEC default 4096).
    Raises:
        ChatTemplateError: a partial render is not a prefix of the full render, or there is no
            assistant turn, or the mask is all ones / all zeros.
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatTemplateError("conversation has no assistant turn to supervise")
    full = render_prompt_ids(tokenizer, messages, template_kwargs, add_generation_prompt=False)
    mask = [0] * len(full)
    end_tokens = {t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
                  if isinstance(t, int) and t >= 0 and t != tokenizer.unk_token_id}
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        head = render_prompt_ids(tokenizer, messages[:i], template_kwargs, add_generation_prompt=True)
        upto = render_prompt_ids(tokenizer, messages[:i + 1], template_kwargs,
                                 add_generation_prompt=False)
        for name, part in (("generation prompt", head), ("turn", upto)):
            if full[:len(part)] != part:
                raise ChatTemplateError(
                    f"chat template renders assistant turn {i} inconsistently: the {name} render "
                    "is not a token prefix of the full conversation, so the loss mask cannot be "
                    "derived")
        start, end = len(head), len(upto)
        span = full[start:end]
        last_end = max((j for j, t in enumerate(span) if t in end_tokens), default=None)
        if last_end is not None:  # supervise through the end-of-turn token, not the newline after
            end = start + last_end + 1
        for j in range(start, end):
            mask[j] = 1
    ids, mask = full[:max_length], mask[:max_length]
    if not any(mask):
        raise ChatTemplateError("loss mask is all zeros (no assistant token within max_length)")
    if all(mask):
        raise ChatTemplateError("loss mask is all ones: the template marks prompt tokens as "
                                "assistant tokens")
    return TokenizedConversation(ids, mask)


def tokenize_conversation_samples(tokenizer, messages: list[dict], template_kwargs: dict,
                                  max_length: int) -> list[TokenizedConversation]:
    """Training samples that supervise every assistant turn of a conversation.

    One sample when the template renders the conversation consistently
    (:func:`tokenize_conversation`); otherwise one sample per assistant turn i: messages[:i]
    rendered with the generation prompt (the prompt serving would see) followed by turn i's tokens,
    supervised through its end-of-turn token.

    Raises:
        ChatTemplateError: no assistant turn, a turn whose own render does not extend its prompt
            render (the template cannot be trusted at all), or an all-zero / all-one mask.
    """
    try:
        return [tokenize_conversation(tokenizer, messages, template_kwargs, max_length)]
    except ChatTemplateError as err:
        if "inconsistently" not in str(err):
            raise
    end_tokens = {t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
                  if isinstance(t, int) and t >= 0 and t != tokenizer.unk_token_id}
    samples = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        head_text = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                                  add_generation_prompt=True, **template_kwargs)
        upto_text = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False,
                                                  add_generation_prompt=False, **template_kwargs)
        if not upto_text.startswith(head_text):
            raise ChatTemplateError(
                f"chat template renders assistant turn {i} so that its prompt render is not a "
                "prefix of the turn's own render: no loss mask can be derived")
        # tokenized as serving sees it: the prompt alone, then the tokens the target generated
        head = tokenizer(head_text, add_special_tokens=False)["input_ids"]
        span = tokenizer(upto_text[len(head_text):], add_special_tokens=False)["input_ids"]
        upto = head + span
        last_end = max((j for j, t in enumerate(span) if t in end_tokens), default=None)
        end = len(head) + (last_end + 1 if last_end is not None else len(span))
        mask = [0] * len(head) + [1] * (end - len(head)) + [0] * (len(upto) - end)
        ids, mask = upto[:max_length], mask[:max_length]
        if not any(mask):
            raise ChatTemplateError(f"assistant turn {i}: no supervised token within max_length")
        samples.append(TokenizedConversation(ids, mask))
    return samples
