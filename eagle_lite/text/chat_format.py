"""How conversations become token ids: the tokenizer's own chat template, or a plain layout for base models.

A base model (GPT-2, Pythia, a pretrained checkpoint) ships no chat template; it continues text. Its turns are
then laid out as plain text, each followed by a blank line, and an assistant turn closed by the tokenizer's EOS
token, so the same conversations can prompt it (generate, eval) and train a draft head for it (distillation,
features), with the target's answer being its continuation of the text so far.

Every text is made valid before the tokenizer sees it (`clean_text`): bytes that were not UTF-8 become U+FFFD
and NUL characters are dropped, so no input a person can type or pipe in stops a tokenizer.
"""
from __future__ import annotations

import re

PLAIN_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ m['content'] }}{% if m['role'] == 'assistant' and eos_token %}{{ eos_token }}{% endif %}{{ '\\n\\n' }}"
    "{%- endfor -%}"
)


# Surrogates that no undecodable byte made (Python's surrogateescape makes only U+DC80..U+DCFF): a lone one, e.g.
# from a JSON escape "\\ud800", has no UTF-8 form at all
_LONE_SURROGATE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def clean_text(text: str) -> str:
    """`text` as valid Unicode for a tokenizer: undecodable bytes become U+FFFD, NUL characters are dropped.

    Python hands over bytes that are not UTF-8 (in argv, or stdin read with errors="surrogateescape") as lone
    surrogates U+DC80..U+DCFF, which tokenizers refuse; they are turned back into their bytes and decoded with
    replacement, as any editor shows them. Every other lone surrogate becomes U+FFFD too. NUL is dropped: it is
    never text a person meant (a binary paste, a stray byte), and some tokenizers map it to an unknown token.
    """
    if text.isascii() and "\0" not in text:
        return text
    text = _LONE_SURROGATE.sub("\ufffd", text.replace("\0", ""))
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def clean_messages(messages: list[dict]) -> list[dict]:
    """`messages` with each text content through `clean_text` (other keys and values as they are)."""
    return [{**m, "content": clean_text(m["content"])} if isinstance(m.get("content"), str) else m for m in messages]


def _template(tokenizer) -> dict:
    """apply_chat_template's template argument: none where the tokenizer has its own (transformers then picks
    it, or its "default" one among several), PLAIN_TEMPLATE where it has none."""
    return {} if getattr(tokenizer, "chat_template", None) else {"chat_template": PLAIN_TEMPLATE}


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The text of `messages` (ready for the assistant's next turn with add_generation_prompt)."""
    return tokenizer.apply_chat_template(clean_messages(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **_template(tokenizer))


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages`, as the template renders them."""
    return list(tokenizer.apply_chat_template(clean_messages(messages), tokenize=True,
                                              add_generation_prompt=add_generation_prompt, return_dict=False,
                                              **_template(tokenizer)))
