"""EAGLE-3 heads in the published layout (SafeAILab/EAGLE `cnets.py`, SpecForge `llama3_eagle.py`, vLLM and
SGLang `llama_eagle3.py`): config.json (a Llama config + draft_vocab_size) + model.safetensors or
pytorch_model.bin (fc [H, 3H], midlayer.*, norm, lm_head [V_draft, H], d2t offsets, t2d; no embed_tokens;
EAGLE-3.1's fc_norm.{0,1,2}). Tapped layers are numbered by output (`draft.published_feature_layers`); explicit
`eagle_aux_hidden_state_layer_ids` are read as SpecForge and SGLang do (`aux_ids="output"`) unless told otherwise,
and written only for non-default taps. docs/deploy.md ("The published layouts", "The tap-layer-id pitfall").
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..heads.checkpoint import check_target, recommended_tree, write_folder
from ..heads.draft import DraftHead, published_feature_layers
from .detect import Layout
from .eagle import load_state
from .llama import check_sizes, config_fields, head_config

ARCHITECTURES = ["LlamaForCausalLMEagle3"]   # vLLM and SGLang both resolve it
LAYER_KEYS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight"}


def aux_layer_ids(config: dict) -> list[int] | None:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return ids if ids is not None else config.get("eagle_aux_hidden_state_layer_ids")


def absolute_d2t(offsets: torch.Tensor, t2d: torch.Tensor | None, vocab: int, where: str) -> torch.Tensor:
    """Target ids of the draft tokens from EAGLE-3's offsets (target = draft + d2t[draft]), checked against t2d."""
    ids = torch.arange(offsets.numel()) + offsets.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or ids.unique().numel() != ids.numel():
        raise ValueError(f"{where}: d2t maps draft tokens outside [0, {vocab}) or two onto one target id: expected "
                         f"offsets (target id = draft id + d2t[draft id])")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,) or int(t2d.bool().sum()) != ids.numel() or not bool(t2d.bool()[ids].all()):
            raise ValueError(f"{where}: t2d [{list(t2d.shape)}] does not mark exactly the target ids d2t maps to")
    return ids


def read_eagle3(layout: Layout, target, aux_ids: str = "output") -> DraftHead:
    """An EAGLE-3 folder (official, SpecForge or speculators) as a DraftHead of design "eagle3" for `target`. aux_ids:
    how an explicit eagle_aux_hidden_state_layer_ids is read, "output" (of layer i: SpecForge, SGLang) or "input"
    (vLLM; always for the speculators layout)."""
    config, where, tensors = layout.config, layout.where, dict(layout.tensors)
    speculators = config.get("speculators_model_type") == "eagle3"   # detect.from_speculators flattened it
    if speculators:
        aux_ids = "input"        # the speculators package numbers taps as vLLM does: the input of layer i
        if config.get("norm_before_residual", True) or config.get("norm_before_fc"):
            raise ValueError(f"{where} is a speculators EAGLE-3 head with norm_before_residual "
                             f"{config.get('norm_before_residual', True)} and norm_before_fc "
                             f"{config.get('norm_before_fc', False)}: eagle_lite runs the official EAGLE-3 layer "
                             f"(the residual is fc's output; no norm over all taps at once), i.e. both false")
    width = config.get("target_hidden_size", config.get("hidden_size"))
    if width != config.get("hidden_size"):
        raise ValueError(f"{where} is {config.get('hidden_size')} wide over a target of width {width} "
                         f"(target_hidden_size): eagle_lite runs heads as wide as their target")
    check_sizes(config, target, where)
    meta = config.get("eagle_lite") or {}
    if "target" in meta:
        check_target(meta, target, layout.folder)
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where} has num_hidden_layers={config['num_hidden_layers']}: eagle_lite runs the "
                         f"one-layer EAGLE-3 head (midlayer)")
    cfg = head_config(config, where)
    hidden, vocab = cfg.hidden_size, target.vocab_size
    draft_vocab = config.get("draft_vocab_size", vocab)
    embedding = tensors.pop("embed_tokens.weight", None)   # the target's embedding is used, as vLLM and SGLang do
    # P-EAGLE (vLLM's parallel drafting): the mask rows' hidden input, and their token as a row of the draft's own
    # embedding (`pard_token`)
    mask_hidden, pard = tensors.pop("mask_hidden", None), config.get("pard_token", config.get("ptd_token_id"))
    fc = tensors.get("fc.weight")
    if fc is None or fc.shape[0] != hidden or fc.shape[1] % hidden or fc.shape[1] // hidden < 2:
        found = None if fc is None else list(fc.shape)
        raise ValueError(f"{where}: fc.weight has shape {found}, but config.json says hidden_size {hidden}: expected "
                         f"[{hidden}, {3 * hidden}] (fc maps the target's low, middle and high layers to H)")
    ids = aux_layer_ids(config)
    if ids is None:
        taps = published_feature_layers(target.config.num_hidden_layers)
    else:
        taps = tuple(int(i) - (aux_ids == "input") for i in ids)
    if len(taps) != fc.shape[1] // hidden:
        raise ValueError(f"{where}: fc.weight reads {fc.shape[1] // hidden} tapped layers, the config names "
                         f"{list(taps)}")
    offsets, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    d2t = None
    if offsets is not None:
        if tuple(offsets.shape) != (draft_vocab,):
            raise ValueError(f"{where}: d2t has shape {list(offsets.shape)}, draft_vocab_size is {draft_vocab}")
        d2t = absolute_d2t(offsets, t2d, vocab, where)
        if draft_vocab == vocab and torch.equal(d2t, torch.arange(vocab)):
            d2t = None                              # the whole vocabulary, in order
    elif draft_vocab != vocab:
        raise ValueError(f"{where}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but the weights hold no d2t: "
                         f"add the vocabulary mapping (SpecForge keeps it in a separate {{d2t, t2d}} file)")
    state = {k: tensors.pop(k) for k in ("fc.weight", "norm.weight", "lm_head.weight") if k in tensors}
    # EAGLE-3.1 (SpecForge's fc_norm): an RMSNorm on each tapped layer before fc
    norms = {k: tensors.pop(k) for k in [f"fc_norm.{i}.weight" for i in range(len(taps))] if k in tensors}
    fc_norm = bool(config.get("fc_norm", False)) or bool(norms)
    if fc_norm and len(norms) != len(taps):
        raise ValueError(f"{where}: fc_norm (EAGLE-3.1) needs fc_norm.{{0..{len(taps) - 1}}}.weight, one per tapped "
                         f"layer; found {sorted(norms)}")
    state.update(norms)
    state.update({"layer." + k.removeprefix("midlayer."): tensors.pop(k) for k in list(tensors)
                  if k.startswith("midlayer.")})
    if tensors:
        raise ValueError(f"{where} holds keys the EAGLE-3 layout has no place for: {sorted(tensors)[:8]}")
    if d2t is not None:
        state["d2t"] = d2t
    # vLLM's norm_output (the post-norm output fed back) where the speculators layout says it; SpecForge's key of
    # that name in the default layout means whether the logits read the norm, which they always do here
    norm_output = speculators and bool(config.get("norm_output", False))
    parallel = 0
    if mask_hidden is not None:
        if pard is None or embedding is None or not 0 <= int(pard) < embedding.shape[0]:
            raise ValueError(f"{where} holds mask_hidden (P-EAGLE) but no pard_token row of its own embed_tokens: "
                             f"the mask rows' token is that row")
        parallel = int(meta.get("parallel") or config.get("num_speculative_tokens") or PARALLEL_TOKENS)
        state["mask_hidden"] = mask_hidden.flatten()
        state["mask_embed"] = embedding[int(pard)]
    head = DraftHead.for_target(target, d2t, feature_layers=taps, design="eagle3", config=cfg, fc_norm=fc_norm,
                                norm_output=norm_output, parallel=parallel)
    load_state(head, state, layout)
    head.tree = recommended_tree(meta, layout.folder, torch.device(target.device).type)
    return head.to(device=target.device, dtype=target.dtype).eval()


def write_eagle3(head: DraftHead, target, out: str | Path, meta: dict, dtype: torch.dtype = torch.bfloat16,
                 engine: str = "all", verifier: str | None = None) -> list[str]:
    """Write an EAGLE-3 head as the folder vLLM (method eagle3), SGLang (EAGLE3) and official EAGLE-3 load, with
    the `speculators` fields vLLM also reads. engine "openvino": with the target's embedding as
    `embed_tokens.weight`, which optimum-intel's LlamaEagle3 draft (optimum-cli export openvino) builds and would
    otherwise leave random; the other loaders take it or the target's, the same tensor. engine "speculators": the
    layout of the `speculators` package (`speculators_config`, `layers.0.*`), which vLLM reads for EAGLE-3 drafts;
    verifier: the target's name or path it records."""
    if head.design != "eagle3":
        what = ("reads its taps through `fuse` into an EAGLE-1 layer (eagle_lite's earlier EAGLE-3 variant)"
                if head.fuse is not None else "is an EAGLE-1/2 head (it reads the last hidden state)")
        raise ValueError(f"this head {what}: the EAGLE-3 layout needs fc over three tapped layers, a 2H-wide "
                         f"attention and its own norm and lm_head; export it with --format eagle, or train "
                         f"experiment=eagle3")
    if len(head.feature_layers) != 3:
        raise ValueError(f"this head reads {len(head.feature_layers)} tapped layers {list(head.feature_layers)}: vLLM "
                         f"and SGLang feed an EAGLE-3 head exactly three (low, middle, high)")
    keys = {k.removeprefix("layer.") for k in head.state_dict() if k.startswith("layer.")}
    if keys != LAYER_KEYS:
        raise ValueError(f"this head's layer has {sorted(keys ^ LAYER_KEYS)} where the EAGLE-3 midlayer has not")
    vocab = target.vocab_size
    ids = torch.arange(vocab) if head.d2t is None else head.d2t.detach().cpu().long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
               **{"midlayer." + k: getattr_path(head.layer, k) for k in sorted(LAYER_KEYS)},
               **({f"fc_norm.{i}.weight": norm.weight for i, norm in enumerate(head.fc_norm)}
                  if head.fc_norm is not None else {})}
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}
    if engine == "openvino":
        tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().to("cpu", dtype).contiguous()
    notes = []
    pard = pard_token(target) if head.parallel else None
    if head.parallel:
        if engine != "all":
            raise ValueError(f"this head drafts {head.parallel} tokens in one forward (P-EAGLE): the layout vLLM "
                             f"reads for parallel drafting is the default one; --engine {engine} has no place for "
                             f"its mask rows")
        embedding = target.embed_tokens.weight.detach().to("cpu", dtype).clone()
        embedding[pard] = head.mask_embed.detach().to("cpu", dtype)
        tensors["embed_tokens.weight"] = embedding.contiguous()
        tensors["mask_hidden"] = head.mask_hidden.detach().to("cpu", dtype).contiguous()
        meta = {**meta, "parallel": head.parallel}
        notes.append(f"a parallel-drafting head (P-EAGLE, {head.parallel} tokens a forward): mask_hidden and "
                     f"\"pard_token\": {pard}, whose row of the head's own embed_tokens is its mask embedding "
                     f"(the target's elsewhere), as vLLM reads them; serve it with --speculative-config "
                     f"'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": "
                     f"{head.parallel}, \"parallel_drafting\": true}}'")
    if head.d2t is not None:
        # a full-vocabulary head has no map: vLLM builds draft_id_to_target_id only for a smaller draft vocabulary
        # and refuses a d2t it has no place for; official EAGLE-3 drops it; OpenVINO's zeros mean the identity
        tensors["d2t"] = (ids - torch.arange(ids.numel())).contiguous()     # offsets, int64
        tensors["t2d"] = t2d
    config = {"architectures": ARCHITECTURES, **config_fields(head.config, vocab, dtype), "num_hidden_layers": 1,
              "draft_vocab_size": int(ids.numel()), "eagle_lite": meta,
              **({"pard_token": pard} if head.parallel else {})}
    if head.norm_output and engine != "speculators":
        raise ValueError("this head feeds its normalised output back to the next draft step (draft.norm_output, "
                         "EAGLE-3.1): vLLM reads that from the speculators layout (--engine speculators); the "
                         "official EAGLE-3 and SpecForge layouts have no field that says it")
    if head.fc_norm is not None:
        config["fc_norm"] = True
        notes.append("the head normalises each tapped layer before fc (EAGLE-3.1): fc_norm.{0,1,2}.weight and "
                     "\"fc_norm\": true as SpecForge writes them and vLLM (0.32, llama_eagle3) reads them; the "
                     "official EAGLE-3 code builds fc without them")
    if engine == "speculators":
        tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in tensors.items()}
        config = speculators_config(head, config, meta, verifier)
        write_folder(out, tensors, config)
        return [f"written in the speculators {SPECULATORS_VERSION} layout: vLLM serves it as the model (`vllm serve "
                f"{out}`: the verifier it records, {config['speculators_config']['verifier']['name_or_path']}, is the "
                f"target), taps named as vLLM reads them, inputs of layers "
                f"{config['eagle_aux_hidden_state_layer_ids']}; SGLang and official EAGLE-3 read the default layout"]
    layers = target.config.num_hidden_layers
    try:
        default = published_feature_layers(layers)
    except ValueError:
        default = None
    if tuple(head.feature_layers) != default:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
                                  "use_aux_hidden_state": True}
        notes.append(f"the head reads the outputs of layers {list(head.feature_layers)}, not the published defaults: "
                     f"config.json names them in SpecForge's and SGLang's convention (output of layer i). vLLM reads "
                     f"the same ids as inputs of layer i, one layer lower: for vLLM set "
                     f"eagle_aux_hidden_state_layer_ids to {[i + 1 for i in head.feature_layers]}; official EAGLE-3 "
                     f"always taps the defaults")
    write_folder(out, tensors, config)
    return notes


SPECULATORS_VERSION = "0.9.0"
PARALLEL_TOKENS = 4      # a P-EAGLE folder that does not say how many tokens it drafts a forward


def pard_token(target) -> int:
    """The token id whose row of a parallel head's own embedding is its mask embedding: the target's padding token
    where it has one, else its last id (the draft only; a real token of that id is embedded as a mask there)."""
    pad = getattr(target.config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) and 0 <= pad < target.vocab_size else target.vocab_size - 1


def speculators_config(head: DraftHead, config: dict, meta: dict, verifier: str | None, tokens: int = 3) -> dict:
    """The speculators package's Eagle3SpeculatorConfig of an EAGLE-3 head whose official config is `config`:
    the Llama fields as transformer_layer_config; norm_before_residual false (the official EAGLE-3 layer: the
    residual is fc's output, not its hidden_norm); fc_norm and norm_output (EAGLE-3.1) as the head has them; the
    taps as vLLM reads the ids, the input of layer i (eagle_lite's output-of-layer ids + 1); one greedy proposal of
    `tokens` drafted tokens (what vLLM uses when the speculative_config names no num_speculative_tokens)."""
    layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size", "eagle_lite",
                                                          "eagle_config", "fc_norm", "norm_output")}
    layer.update({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "tie_word_embeddings": False})
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": head.fc_norm is not None,   # EAGLE-3.1: an RMSNorm on each tap before fc
        "norm_output": head.norm_output,        # vLLM: the post-norm output fed back to the next draft step
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in head.feature_layers],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier or meta.get("target", {}).get("name", "target"),
                         "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": config["torch_dtype"],
        "eagle_lite": meta,
    }


def getattr_path(module: torch.nn.Module, key: str) -> torch.Tensor:
    """module's tensor under a state-dict key ("self_attn.q_proj.weight")."""
    for part in key.split("."):
        module = getattr(module, part)
    return module
