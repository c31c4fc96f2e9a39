"""How conversations become token ids: the tokenizer's own chat template, or a plain layout for base models.

A model without a chat template gets its turns as plain text, each followed by a blank line, an assistant turn
closed by the EOS token, so the same conversations prompt it and train its head (docs/training.md, "The prompt
layout"). Ids are built as the model's own tokenizer builds them: a chat template writes its own start token; the
plain layout and plain text (`text_ids`, `--raw`) start with the tokens the tokenizer puts in front of a text (its
BOS policy, `special_affixes`), and a prompt gets no policy EOS (the model continues it).

Every text is made valid first (`clean_text`): bytes that were not UTF-8 become U+FFFD and NUL characters are dropped.
"""
from __future__ import annotations

import re

PLAIN_TEMPLATE = (
    "{%- if bos_prefix -%}{{ bos_prefix }}{%- endif -%}"
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


def special_affixes(tokenizer) -> tuple[list[int], list[int]]:
    """The special token ids the tokenizer adds before and after a text (its BOS / EOS policy), read from what it
    does rather than from flags, so a hub tokenizer's post-processor and a GGUF file's `add_bos_token` /
    `add_eos_token` (carried into the converted tokenizer) count alike."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False).input_ids
    full = tokenizer(probe).input_ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain):])
    return [], []


def _template(tokenizer) -> dict:
    """apply_chat_template's template arguments: none where the tokenizer has its own (transformers then picks
    it, or its "default" one among several; it writes its own start token), PLAIN_TEMPLATE where it has none,
    starting with the tokens the tokenizer puts in front of a text."""
    if getattr(tokenizer, "chat_template", None):
        return {}
    prefix = special_affixes(tokenizer)[0]
    return {"chat_template": PLAIN_TEMPLATE, "bos_prefix": tokenizer.decode(prefix) if prefix else ""}


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The text of `messages` (ready for the assistant's next turn with add_generation_prompt)."""
    return tokenizer.apply_chat_template(clean_messages(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **_template(tokenizer))


def text_ids(tokenizer, text: str) -> list[int]:
    """The ids of plain `text` as a prompt (`--raw`): the tokenizer's own prefix (its BOS) and the text's tokens,
    without a policy EOS after them (the model continues the text)."""
    prefix = special_affixes(tokenizer)[0]
    return prefix + tokenizer(clean_text(text), add_special_tokens=False).input_ids


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """The token ids of `messages`, as the template renders them."""
    return list(tokenizer.apply_chat_template(clean_messages(messages), tokenize=True,
                                              add_generation_prompt=add_generation_prompt, return_dict=False,
                                              **_template(tokenizer)))
