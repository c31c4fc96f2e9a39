"""One detokenizer for the server, the CLI and the library: each step decodes a short window of the latest tokens,
and the pieces join to the text decoding every token at once gives (a character split across tokens held back until
it is whole, a leading space dropped once, a stop string cut)."""
from __future__ import annotations

import pytest
import torch
from conftest import make_target
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eagle_lite.pipeline import Pipeline, load
from eagle_lite.text.detokenize import Detokenizer

# multi-byte characters: é and ï are two bytes, € three, 😀 four
TEXT = "café: 5 € — naïve 😀 ok\n" * 8


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level: one token per UTF-8 byte, so every character past ASCII is split across tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class Steps:
    """An engine that accepts `ids` a few tokens a step (1 to 3, seeded)."""

    def __init__(self, ids: list[int], seed: int) -> None:
        self.ids, self.g = ids, torch.Generator().manual_seed(seed)

    def stream(self, prompt_ids, cfg, stats=None):
        at = 0
        while at < len(self.ids):
            step = int(torch.randint(1, 4, (1,), generator=self.g))
            yield self.ids[at:at + step]
            at += step


def test_the_library_stream_joins_to_the_whole_decode_and_decodes_a_window_per_step():
    target = make_target("llama")
    target.tokenizer = byte_tokenizer()
    ids = target.tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT) and target.tokenizer.decode(ids) == TEXT   # split characters, decoded back whole
    for seed in range(5):
        lm = Pipeline(target, None, "steps")
        lm.engine = Steps(ids, seed)
        decoded: list[int] = []   # the length of every decode the stream asks for

        def decode(token_ids, lm=lm, decoded=decoded):
            decoded.append(len(token_ids))
            return Pipeline.decode(lm, token_ids)

        lm.decode = decode
        got: list[int] = []
        pieces = list(lm.stream([1, 2, 3], token_ids=got))
        assert "".join(pieces) == TEXT and got == ids
        assert all(piece and "\ufffd" not in piece for piece in pieces)   # no half character is ever shown
        assert len(pieces) > len(TEXT) // 4
        # a window of the latest tokens (it grows only while steps keep ending inside a character), never the
        # whole answer's 256 as each step of the old stream did
        assert max(decoded) <= 32, (decoded, len(ids))


def test_the_library_stream_is_the_generated_text(tiny_model_dir):
    lm = load(str(tiny_model_dir), method="vanilla")
    cfg = lm.config(max_new_tokens=40)
    prompt = [{"role": "user", "content": "hello there"}]
    assert "".join(lm.stream(prompt, cfg)) == lm.generate(prompt, cfg).text


@pytest.mark.parametrize("stops", [[], ["é!"], ["cat"]])
def test_streamed_text_is_the_whole_answer_decoded_at_once(stops):
    """The detokenizer decodes a short window of the latest tokens each step; its pieces still add up to the text
    decoding every token at once gives (a SentencePiece-style leading space dropped, a character split across
    tokens held back until complete), cut before the first stop string."""
    pieces = [b" the", b" cat", b" caf", b"\xc3", b"\xa9", b"!", b" \xe2\x82", b"\xac", b"1", b" ok", b"\n"]

    def decode(ids):   # bytes joined, undecodable bytes shown as U+FFFD, one leading space dropped
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace").removeprefix(" ")

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(len(pieces), (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        text, out, at = Detokenizer(decode, stops), [], 0
        while at < len(ids) and not text.stopped:
            step = int(torch.randint(1, 4, (1,), generator=g))
            out.append(text.add(ids[at:at + step]))
            at += step
        if not text.stopped:
            out.append(text.add([], final=True))
        whole = decode(ids)
        cut = min((whole.find(s) for s in stops if s in whole), default=len(whole))
        assert "".join(out) == whole[:cut]
        assert text.stopped == (cut < len(whole))
