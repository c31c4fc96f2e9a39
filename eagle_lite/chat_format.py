"""How conversations become token ids: the tokenizer's own chat template, or a plain layout for base models.

A base model (GPT-2, Pythia, a pretrained checkpoint) ships no chat template; it continues text. Its turns are
then laid out as plain text, each followed by a blank line, and an assistant turn closed by the tokenizer's EOS
token, so the same conversations can prompt it (generate, eval) and train a draft head for it (distillation,
features), with the target's answer being its continuation of the text so far.
"""
from __future__ import annotations

PLAIN_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ m['content'] }}{% if m['role'] == 'assistant' and eos_token %}{{ eos_token }}{% endif %}{{ '\\n\\n' }}"
    "{%- endfor -%}"
)


def _template(tokenizer) -> dict:
    """apply_chat_template's template argument: none where the tokenizer has its own (transformers then picks
    it, or its "default" one among several), PLAIN_TEMPLATE where it has none."""
    return {} if getattr(tokenizer, "chat_template", None) else {"chat_template": PLAIN_TEMPLATE}


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The text of `messages` (ready for the assistant's next turn with add_generation_prompt)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **_template(tokenizer))


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages`, as the template renders them."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                              return_dict=False, **_template(tokenizer)))
