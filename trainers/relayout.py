"""Move a trained EAGLE head into the layout the serving engines build (vLLM, SGLang, official EAGLE), to fine-tune.

eagle_lite's earlier heads have `fc.bias` and an input RMSNorm in their decoder layer; vLLM's `llama_eagle` builds fc
without a bias and replaces layer 0's input norm by the identity, so such a head exported as is would be served wrong.
`relayout` builds the head without them and carries the weights over:

- the fc bias is dropped (no constant input could absorb it); fine-tuning recovers what it held;
- the input norm `gamma * x / rms(x)` is folded into the attention's q/k/v projections as `gamma / r`, r being the
  mean RMS of fc's output over a sample of training pairs: exact for a token whose fc output has RMS r, close for
  the rest, and again fine-tuning does the remainder.

`python -m trainers.validate` on the folded head before any training shows what the move alone costs.

`with_fc_norm` gives a trained EAGLE-3 head EAGLE-3.1's norm of each tapped layer before fc (`draft.fc_norm`): each
norm's weight starts at its tap's mean RMS over a sample of training pairs, so that fc reads what it read before for
a token whose tap has that RMS, as the input-norm fold does.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from eagle_lite.heads.draft import DraftHead

log = logging.getLogger("trainers.relayout")


def fc_rms(head: DraftHead, hidden: torch.Tensor, embeds: torch.Tensor) -> float:
    """Mean RMS over tokens of the head's fc output for inputs hidden, embeds [N, H]."""
    with torch.no_grad():
        x = head.fc(torch.cat([embeds, hidden], dim=-1).to(head.fc.weight.dtype))
        return float(x.float().pow(2).mean(-1).sqrt().mean())


def relayout(head: DraftHead, target, fc_bias: bool, input_norm: bool, rms: float | None = None) -> DraftHead:
    """`head` rebuilt with (fc_bias, input_norm) as asked, its weights carried over (module doc). rms: the mean RMS
    of fc's output (`fc_rms`), needed only where an input norm is removed."""
    if head.design != "eagle" or head.fuse is not None:
        raise ValueError("draft.fc_bias / draft.input_norm apply to EAGLE-1/2 heads reading the last hidden state")
    if input_norm and not head.input_norm:
        raise ValueError("cannot give a head an input norm it was not trained with: start from scratch instead")
    if (fc_bias, input_norm) == (head.fc_bias, head.input_norm):
        return head
    new = DraftHead.for_target(target, d2t=head.d2t, layer_class=type(head.layer).__name__, fc_bias=fc_bias,
                               input_norm=input_norm).float()
    state = {k: v for k, v in head.state_dict().items()
             if not (k == "fc.bias" and not fc_bias) and not (k.startswith("layer.input_layernorm") and not input_norm)}
    if head.input_norm and not input_norm:
        if rms is None or rms <= 0:
            raise ValueError("folding the input norm needs the mean RMS of fc's output (fc_rms)")
        scale = head.layer.input_layernorm.weight.detach().float() / rms          # H
        attn = head.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            proj: nn.Linear = getattr(attn, name)
            state[f"layer.self_attn.{name}.weight"] = proj.weight.detach().float() * scale[None, :]
    if fc_bias and not head.fc_bias:
        state["fc.bias"] = torch.zeros(new.fc.bias.shape)    # a zero bias: the same function
    missing, unexpected = new.load_state_dict(state, strict=False)
    left = list(missing)
    if left or unexpected:
        raise ValueError(f"relayout: weights do not carry over (missing {left}, unexpected {unexpected})")
    log.info("relayout: fc bias %s -> %s, input norm %s -> %s%s", head.fc_bias, fc_bias, head.input_norm, input_norm,
             f" (folded into q/k/v at rms {rms:.3f})" if head.input_norm and not input_norm else "")
    return new


def tap_rms(taps: torch.Tensor, n: int) -> torch.Tensor:
    """[n]: the mean RMS over tokens of each of the n tapped layers side by side in taps [N, n * H]."""
    with torch.no_grad():
        return taps.float().unflatten(-1, (n, -1)).pow(2).mean(-1).sqrt().mean(0)


def with_fc_norm(head: DraftHead, target, rms: torch.Tensor) -> DraftHead:
    """`head` (design eagle3, without fc_norm) rebuilt with an RMSNorm on each tapped layer before fc, its weights
    carried over and norm i's weight set to rms[i] (`tap_rms`): module doc."""
    if head.design != "eagle3":
        raise ValueError("draft.fc_norm (EAGLE-3.1's norm of each tapped layer) applies to design eagle3 heads; "
                         f"draft.init_from is a {head.design} head")
    if head.fc_norm is not None:
        return head
    if rms.numel() != len(head.feature_layers) or not bool((rms > 0).all()):
        raise ValueError(f"with_fc_norm needs the mean RMS of each of the {len(head.feature_layers)} taps, got "
                         f"{rms.tolist()}")
    new = DraftHead.for_target(target, d2t=head.d2t, feature_layers=head.feature_layers, design="eagle3",
                               config=head.config, fc_norm=True).float()
    state = dict(head.state_dict())
    hidden = head.fc.out_features
    for i, r in enumerate(rms.tolist()):
        state[f"fc_norm.{i}.weight"] = torch.full((hidden,), float(r))
    missing, unexpected = new.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"with_fc_norm: weights do not carry over (missing {list(missing)}, unexpected {unexpected})")
    new.tree = head.tree
    log.info("fc_norm: each tapped layer normalised before fc, the norms starting at the taps' mean RMS %s",
             ", ".join(f"{r:.3f}" for r in rms.tolist()))
    return new
