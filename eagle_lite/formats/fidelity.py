"""What each engine builds of an EAGLE-1/2 head, and what it loses of one it cannot build, measured: the share of
positions where the engine's first drafted token is the target's next token, against the head's own, on a few
prompts the target continues greedily. The export refuses a folder (unless --allow-lossy) only where the share
drops by more than export.AGREEMENT_MARGIN. The table of what each engine builds: docs/deploy.md, "Export".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ENGINES = ("official", "sglang", "vllm")
NAMES = {"official": "official EAGLE", "sglang": "SGLang", "vllm": "vLLM"}
PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a cat who likes rain.",
    "What are three tips for learning a new language?",
    "Give me a simple recipe for pancakes.",
)


@dataclass(frozen=True)
class View:
    """How an engine runs the head: without its fc bias, over the full vocabulary (instead of d2t's)."""
    drop_bias: bool = False
    full_vocab: bool = False

    @property
    def exact(self) -> bool:
        return not (self.drop_bias or self.full_vocab)

    def losses(self, head) -> list[str]:
        out = []
        if self.drop_bias:
            out.append(f"builds fc without its bias (norm {float(head.fc.bias.detach().float().norm()):.2f})")
        if self.full_vocab:
            out.append(f"drafts over the full vocabulary, not the head's {head.d2t.numel()} tokens")
        return out


def engine_view(head, engine: str, vllm_layout: bool = False) -> View:
    """How `engine` runs `head` (an EAGLE-1/2 DraftHead) from eagle_lite's export; vllm_layout: the folder was
    written with --engine vllm (fc bias carried exactly where the layer has an input norm)."""
    from .eagle import vllm_carries_bias

    has_bias = head.fc_bias and bool(head.fc.bias.detach().any())
    reduced = head.d2t is not None
    if engine == "sglang":
        return View()
    if engine == "official":
        return View(full_vocab=reduced)
    if engine == "vllm":
        return View(drop_bias=has_bias and not (vllm_layout and vllm_carries_bias(head)), full_vocab=reduced)
    raise ValueError(f"unknown engine {engine!r}: expected one of {', '.join(ENGINES)}")


def reference_sequences(target, prompts=PROMPTS, new_tokens: int = 40) -> list[tuple[torch.Tensor, int]]:
    """(prompt + the target's greedy continuation, prompt length) per prompt, chat-formatted when the tokenizer
    has a template."""
    from tqdm.auto import tqdm

    from ..text.chat_format import chat_ids

    seqs = []
    # the slow part of an export (the target answers each prompt with transformers' generate): a bar on a terminal
    for text in tqdm(prompts, desc="the target's answers to compare the head with", unit="prompt", leave=False,
                     disable=None):
        if target.tokenizer is not None:
            ids = chat_ids(target.tokenizer, [{"role": "user", "content": text}])
        else:
            ids = [(7 * i + len(text)) % target.vocab_size for i in range(12)]
        ids = torch.tensor([ids], device=target.device)
        with torch.no_grad(), target.stock():
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                        do_sample=False, pad_token_id=0)
        seqs.append((out[0], ids.shape[1]))
    return seqs


def first_token_drafts(head, target, seqs, view: View) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence of `seqs`: (the first token `head`, run as `view` says, drafts at each continuation position,
    the target's token there). At position t the head reads the target's feature at t and token t+1, and drafts
    token t+2."""
    saved = head.fc.bias.detach().clone() if view.drop_bias else None
    out_rows = []
    try:
        if saved is not None:
            with torch.no_grad():
                head.fc.bias.zero_()
        for ids, prompt_len in seqs:
            n = ids.numel() - 2
            with torch.no_grad(), target.stock():
                hidden = target.decoder(ids[None]).last_hidden_state[0, :n]
                embeds = target.embed_tokens(ids[1:n + 1])
                mask = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()[None, None]
                positions = torch.arange(n, device=ids.device)[None]
                out = head(hidden[None], embeds[None], positions, mask)[0]
                lm = target.lm_head.weight
                weight = lm if view.full_vocab else head.output_weight(lm)
                pred = (head.logit_features(out).to(weight.dtype) @ weight.T).argmax(-1)
                if head.d2t is not None and not view.full_vocab and head.lm_head is None:
                    pred = head.d2t[pred]
            first = max(prompt_len - 2, 0)                                  # the continuation only
            out_rows.append((pred[first:], ids[2:][first:]))
    finally:
        if saved is not None:
            with torch.no_grad():
                head.fc.bias.copy_(saved)
    return out_rows


def first_token_agreement(head, target, seqs, view: View) -> tuple[int, int]:
    """(positions where the first drafted token is the target's, positions), over `first_token_drafts`."""
    rows = first_token_drafts(head, target, seqs, view)
    return sum(int((p == t).sum()) for p, t in rows), sum(t.numel() for _, t in rows)


@dataclass(frozen=True)
class Loss:
    """What one engine runs differently of a head, and the first-token agreement measured with and without that."""
    engine: str
    differs: tuple[str, ...]   # View.losses: what the engine builds differently
    agree: int                 # positions where the engine's first drafted token is the target's
    exact: int                 # the same for the head as trained
    positions: int
    prompts: int

    @property
    def drop(self) -> float:
        """How far the engine's agreement falls below the head's own, a share of the positions (< 0: it gains)."""
        return (self.exact - self.agree) / max(self.positions, 1)

    def sentence(self) -> str:
        n = max(self.positions, 1)
        return (f"{NAMES[self.engine]} {' and '.join(self.differs)}: its first drafted token is the target's on "
                f"{self.agree / n:.0%} of {self.positions} positions, against {self.exact / n:.0%} for the head as "
                f"trained ({self.prompts} prompts; output stays lossless, only the accepted share can change)")


def measured_losses(head, target, engines, vllm_layout: bool = False, seqs=None) -> list[Loss]:
    """Per engine of `engines` that runs `head` inexactly: what differs and the measured first-token agreement of
    its view against the head's own; engines that run the head exactly are left out."""
    views = {e: engine_view(head, e, vllm_layout) for e in engines}
    lossy = {e: v for e, v in views.items() if not v.exact}
    if not lossy:
        return []
    seqs = reference_sequences(target) if seqs is None else seqs
    exact, n = first_token_agreement(head, target, seqs, View())
    return [Loss(engine, tuple(view.losses(head)), first_token_agreement(head, target, seqs, view)[0], exact, n,
                 len(seqs)) for engine, view in lossy.items()]
