"""Ids built as the model's own tokenizer builds them: its BOS / EOS policy, with and without a chat template."""
from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from eagle_lite.text.chat_format import chat_ids, chat_text, special_affixes, text_ids

BOS, EOS = 1, 2
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}|{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")


def tokenizer(adds_bos: bool, adds_eos: bool = False, template: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer that puts <bos> before a text and/or <eos> after it, as its policy says."""
    specials = ["<unk>", "<bos>", "<eos>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    single = " ".join((["<bos>"] if adds_bos else []) + ["$A"] + (["<eos>"] if adds_eos else []))
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<bos>", BOS), ("<eos>", EOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")
    fast.chat_template = template
    return fast


def plain(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


USER = [{"role": "user", "content": "hi"}]


def test_a_template_less_model_that_asks_for_bos_gets_it_in_the_plain_layout():
    """Gemma 3's GGUF: no chat template, add_bos_token true. Without the BOS it writes junk."""
    tok = tokenizer(adds_bos=True)
    assert special_affixes(tok) == ([BOS], [])
    assert chat_ids(tok, USER) == [BOS] + plain(tok, "hi\n\n")
    assert chat_text(tok, USER) == "<bos>hi\n\n"
    # distillation tokenizes the rendered text piece by piece without special tokens: the same ids
    assert plain(tok, chat_text(tok, USER)) == chat_ids(tok, USER)
    turns = USER + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    assert chat_ids(tok, turns) == [BOS] + plain(tok, "hi\n\nyo") + [EOS] + plain(tok, "\n\n?\n\n")
    assert text_ids(tok, "hi") == [BOS] + plain(tok, "hi")          # --raw


def test_a_template_less_model_without_a_bos_policy_gets_none():
    tok = tokenizer(adds_bos=False)
    assert special_affixes(tok) == ([], [])
    assert chat_ids(tok, USER) == plain(tok, "hi\n\n")
    assert text_ids(tok, "hi") == plain(tok, "hi")


def test_an_eos_policy_is_left_off_a_prompt_the_model_continues():
    tok = tokenizer(adds_bos=True, adds_eos=True)
    assert special_affixes(tok) == ([BOS], [EOS])
    assert tok("hi").input_ids[-1] == EOS
    assert text_ids(tok, "hi") == [BOS] + plain(tok, "hi")
    assert chat_ids(tok, USER) == [BOS] + plain(tok, "hi\n\n")


@pytest.mark.parametrize("adds_bos", [True, False])
def test_a_chat_template_writes_its_own_start_token_once(adds_bos):
    tok = tokenizer(adds_bos=adds_bos, template=TEMPLATE)
    ids = chat_ids(tok, USER)
    assert ids == [BOS] + plain(tok, "<u>hi|<a>")
    assert ids.count(BOS) == 1


def test_distillation_and_the_pipeline_build_the_same_ids(tmp_path):
    """The distill stage's prompt ids and the pipeline's (generate, serve, eval) for a template-less BOS model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_lite import load
    from trainers.distill import _Chat
    from trainers.sharegpt import Conversation, Turn

    tok = tokenizer(adds_bos=True)
    tok.save_pretrained(tmp_path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS, pad_token_id=3,
                                 bos_token_id=BOS)).save_pretrained(tmp_path)
    lm = load(str(tmp_path), method="vanilla")
    assert lm.prompt_ids("hi") == [BOS] + plain(tok, "hi\n\n")
    assert lm.prompt_ids("hi", chat_template=False) == [BOS] + plain(tok, "hi")
    chat = _Chat(Conversation("c1", [Turn("user", "hi")]))
    assert chat.next_prompt(0, lm.target.tokenizer, 512) == lm.prompt_ids("hi")
