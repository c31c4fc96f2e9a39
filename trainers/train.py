"""Train an EAGLE draft head: distill -> features -> fit -> export. Every stage resumes.

  python -m trainers.train target=./my-model data=quick     # your own model (a folder, .gguf or hub id): a first
                                                            # head in minutes, filed under the model's name
  python -m trainers.train                                  # the default recipe on SmolLM2 (CPU): distilled
                                                            # answers + ShareGPT text, an 8k draft vocabulary
  python -m trainers.train experiment=ttt                   # + training-time test (3 unrolled steps)
  python -m trainers.train experiment=full_vocab            # the target's whole vocabulary instead
  python -m trainers.train experiment=medusa                # Medusa heads instead (draft=medusa)
  python -m trainers.train target=tiny data=tiny debug=fdr  # the whole pipeline in seconds
  python -m trainers.train trainer=ddp                      # all GPUs of the machine (Lightning DDP; trainer=fsdp)
  torchrun --standalone --nproc_per_node=8 -m trainers.train trainer=ddp   # the same, distill and features shared
  python -m trainers.train data.features.mode=online        # no feature cache: the fit's target computes them
  python -m trainers.train name=more draft.init_from=eagle_lite/heads/smollm2   # fine-tune the shipped head
  python -m trainers.train --help                           # every config group and option

Several processes or machines (trainer.devices, trainer.num_nodes; torchrun, SLURM): docs/training.md, "Scaling out".

Stages (each a no-op when its output is complete, so rerunning the same command resumes):
  1. distill   the target answers the training prompts (`trainers.distill`) -> paths.distill
  2. features  the target's hidden states over those sequences (`trainers.features`) -> paths.features
  3. fit       Lightning; a checkpoint every `checkpoint.every_n_train_steps` steps in
               paths.output/checkpoints; with `resume=true` a run continues from its `last.ckpt`.
               Those checkpoints are torch pickles that this same pipeline wrote; they are loaded
               with torch's restricted `weights_only=True` unpickler, and only from our own run folder.
               Exported heads are safetensors only.
               With `early_stopping` set, fitting stops once its validation metric has not improved for
               `patience` epochs, and the best epoch's weights (checkpoints/best.ckpt) are the ones exported.
  4. export    `save_head` (model.safetensors + config.json with the target's fingerprint), the
               resolved config (train_config.yaml), train_log.json / train_log.md and training_curve.png
               (train and validation loss, top-1 and estimated acceptance per epoch, per kind too) -> paths.export
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from eagle_lite.atomic import write_text_atomic
from eagle_lite.cli import hydra_entry, one_line
from eagle_lite.config import check_whole

from .ranks import Ranks, current, join
from .targets import run_name

log = logging.getLogger("trainers.train")
# conf/train.yaml: ${rank_zero:value,other} is value on rank 0 of a run over several ranks, else other (default null)
OmegaConf.register_new_resolver("rank_zero", lambda value, other=None: value if current().zero else other,
                                replace=True)
# conf/target/*.yaml: ${target_name:${target.spec}} files a pretrained target's runs under the model's own name
OmegaConf.register_new_resolver("target_name", run_name, replace=True)
# conf/data/sharegpt_mix.yaml: ${scaled:n,ratio}, a mix source's size following the main source's limit
OmegaConf.register_new_resolver("scaled", lambda n, ratio: max(1, round(int(n) * float(ratio))), replace=True)
CONF = Path(__file__).resolve().parents[1] / "conf"


def own_target(overrides: list[str]) -> list[str]:
    """The command line's `target=MODEL` where MODEL is no config of conf/target/ (a local folder, a .gguf file or a
    hub id), as the overrides Hydra composes: `target=pretrained target.spec=MODEL`. The run is then filed under the
    model's own name (`targets.run_name`) unless target.name is given."""
    known = {p.stem for p in (CONF / "target").glob("*.yaml")}
    out = []
    for arg in overrides:
        key, eq, value = arg.partition("=")
        if eq and key == "target" and not set(value.split(",")) <= known:   # a multirun's target=tiny,smollm2 stays
            quote = "'" if "'" not in value else '"'
            out += ["target=pretrained", f"target.spec={quote}{value}{quote}"]
        else:
            out.append(arg)
    return out


def _container(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def _typed(cls, node):
    """A dataclass from a config node; unknown keys fail loudly, naming the class."""
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    try:
        return cls(**values)
    except TypeError as err:
        raise ValueError(f"config for {cls.__name__} has keys {sorted(values)}: {err}") from err


class DataSource(NamedTuple):
    name: str                        # "main" (the data's own) or the `data.mix` entry's key
    settings: DictConfig | dict      # its distill settings
    distill: str                     # its distill folder
    features: str                    # its feature cache folder


def data_sources(cfg: DictConfig) -> list[DataSource]:
    """The data's own source and one per `data.mix` entry.

    A mix entry's `distill` keys override the data's own; its folders are `<paths.data>/<entry>/distill` and
    `<paths.data>/<entry>/<the name of paths.features>` (so an EAGLE-3 cache, `features_eagle3`, has its own folder
    there too). It does not inherit `start_from` (the main source's committed answers are not its own). An entry set
    to null is left out (`data.mix.text4=null`: a source whose cache is still being computed elsewhere).
    """
    paths = cfg.paths
    sources = [DataSource("main", cfg.data.distill, paths.distill, paths.features)]
    for name, entry in (cfg.data.get("mix") or {}).items():
        if entry is None:
            continue
        settings = {**OmegaConf.to_container(cfg.data.distill, resolve=True), "start_from": None,
                    **OmegaConf.to_container(entry.get("distill") or {}, resolve=True)}
        folder = Path(paths.data) / str(name)
        sources.append(DataSource(str(name), settings, str(folder / "distill"),
                                  str(folder / Path(str(paths.features)).name)))
    return sources


def distill_only(cfg: DictConfig, target, sources: list[DataSource], ranks: Ranks = Ranks()) -> dict:
    """Stage 1 alone for every source (stop_after=distill): e.g. answer the prompts on a CPU now, cache features
    and fit on a GPU later from the same folders."""
    from .distill import DistillConfig, distill

    t0 = time.perf_counter()
    summaries = [distill(target, _typed(DistillConfig, s.settings), s.distill, progress=cfg.progress, ranks=ranks)
                 for s in sources]
    records, tokens = sum(x.records for x in summaries), sum(x.tokens for x in summaries)
    log.info("stop_after=distill: %d answered sequences (%d tokens) in %s", records, tokens,
             ", ".join(str(s.distill) for s in sources))
    new_tokens, seconds = sum(x.new_tokens for x in summaries), sum(x.seconds for x in summaries)
    return {"experiment": cfg.name, "sequences": records, "tokens": tokens, "new_tokens": new_tokens,
            "new_tokens_per_s": round(new_tokens / seconds, 1) if seconds > 0 else 0.0,
            "seconds_distill": round(time.perf_counter() - t0, 1), "stage": "distill"}


def feature_layers(cfg: DictConfig, target) -> tuple[int, ...]:
    """The target's decoder layers the head reads (EAGLE-3), from `draft.feature_layers`: null or [] (the last
    hidden state, EAGLE-1/2), "auto" (low, middle, high: `auto_feature_layers`) or a list; a head fine-tuned from
    `draft.init_from` keeps its own."""
    from eagle_lite.formats import load_head
    from eagle_lite.heads.draft import auto_feature_layers, published_feature_layers

    if cfg.draft.get("init_from"):   # any head folder --draft takes: eagle_lite's or a published layout
        return load_head(cfg.draft.init_from, target).feature_layers
    layers = cfg.draft.get("feature_layers")
    eagle3 = cfg.draft.get("design", "eagle") == "eagle3"
    if not layers and not eagle3:
        return ()
    if cfg.draft.get("kind", "eagle") == "medusa":
        raise ValueError("draft.feature_layers is for EAGLE heads; Medusa heads read the last hidden state")
    if not layers or layers == "auto":
        # the published EAGLE-3 head's taps (inputs of layers 2, L//2, L-3), else eagle_lite's earlier choice; a
        # stack too short for the published three (L < 7) gets three spread over the layers it has
        count = target.config.num_hidden_layers
        pick = (auto_feature_layers if not eagle3 else published_feature_layers if count >= 7 else
                short_stack_taps)
        layers = pick(count)
        if eagle3 and count < 7:
            log.info("draft.feature_layers: target '%s' has %d decoder layers, too few for the published EAGLE-3 "
                     "taps; the head reads layers %s", target.name, count, list(layers))
    else:
        layers = tuple(int(i) for i in layers)
    target.check_taps(layers, "draft.feature_layers")
    return layers


def short_stack_taps(num_layers: int) -> tuple[int, ...]:
    """Three EAGLE-3 taps for a stack of 4 to 6 decoder layers: the first, middle and last layer the head may read
    (outputs 0 to L-2; the last layer's output is the final hidden state)."""
    taps = (0, (num_layers - 2) // 2, num_layers - 2)
    if len(set(taps)) != 3:
        raise ValueError(f"an EAGLE-3 head reads three decoder layers' outputs from 0 to L-2, and this target has "
                         f"L = {num_layers}: train an EAGLE-1 head instead (draft.design=eagle), which reads the last "
                         f"hidden state")
    return taps


def group_names(cfg: DictConfig, sources: list[DataSource]) -> list[str]:
    """Each source's validation group name (for sequences whose ids name no kind): the main source by its
    `data.distill.source` (e.g. "sharegpt"), a `data.mix` entry by its key."""
    return [str(cfg.data.distill.source) if s.name == "main" else s.name for s in sources]


def prepare_data(cfg: DictConfig, target, sources: list[DataSource], taps: tuple[int, ...] = (),
                 ranks: Ranks = Ranks()):
    """Stages 1-2 for every source of `data_sources(cfg)`: distill and cache features (each resumes);
    returns (stage seconds, manifest, datamodule). taps: the decoder layers the head reads (`feature_layers`),
    cached beside the last hidden states.

    With `data.mix`, every source is prepared in turn and the datamodule reads all their caches; the
    returned manifest then sums their sequences and tokens. ranks: the processes sharing the stages (`trainers.ranks`).
    """
    from .datamodule import DraftDataModule, LoaderConfig
    from .distill import DistillConfig, distill
    from .features import FeatureConfig, cache_features
    from .online import OnlineFeatures, RecordCache

    seconds = {"seconds_distill": 0.0, "seconds_features": 0.0}
    manifests, records = [], []
    features = FeatureConfig(**{**_container(cfg.data.features), "feature_layers": taps})
    for source in sources:
        if source.name != "main":
            log.info("data.mix source '%s': %s", source.name, Path(source.distill).parent)
        t0 = time.perf_counter()
        distill(target, _typed(DistillConfig, source.settings), source.distill, progress=cfg.progress, ranks=ranks)
        t1 = time.perf_counter()
        answers = checked_records(cfg, target, source)
        if features.mode == "online":   # the fit computes the features: nothing to cache
            records.append(RecordCache(answers, features.max_len, source.features, taps))
            manifests.append({"total_sequences": len(records[-1].ids),
                              "total_tokens": sum(len(t) for t in records[-1].tokens)})
        else:
            manifests.append(cache_features(target, answers, source.features, features,
                                            progress=cfg.progress, ranks=ranks))
        seconds["seconds_distill"] = round(seconds["seconds_distill"] + t1 - t0, 1)
        seconds["seconds_features"] = round(seconds["seconds_features"] + time.perf_counter() - t1, 1)
    manifest = {**manifests[0], **{k: sum(m[k] for m in manifests) for k in ("total_sequences", "total_tokens")}}
    loader = _typed(LoaderConfig, cfg.data.loader)
    data = DraftDataModule([s.features for s in sources], loader, expect_target=target.fingerprint(),
                           feature_layers=taps, names=group_names(cfg, sources), records=records or None)
    data.online_features = OnlineFeatures(target, loader.max_len, loader.pack, taps) if records else None
    data.setup("fit")
    return seconds, manifest, data


def checked_records(cfg: DictConfig, target, source: DataSource) -> list[dict]:
    """A source's answered records after the data check (trainers/answer_check.py): degenerate answers the target
    wrote are dropped, and too many of them stop the run; `data.max_degenerate` (null: no check) sets how many."""
    from .answer_check import CHECKED_SOURCES, check_answers
    from .distill import read_records

    records = list(read_records(source.distill))
    if source.settings["source"] not in CHECKED_SOURCES:
        return records
    eos = set(target.eos_token_ids)
    tokenizer = target.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return check_answers(records, tokenizer, eos, cfg.data.get("max_degenerate"), str(source.distill))


REVOCAB_NEEDS_INIT = ("draft.revocab re-chooses the draft vocabulary of the head draft.init_from names: set "
                      "draft.init_from, or drop draft.revocab (a new head chooses its vocabulary from its data)")
FC_NORM_NEEDS_EAGLE3 = ("draft.fc_norm (EAGLE-3.1's norm of each tapped layer before fc) is an option of EAGLE-3 "
                        "heads: set draft.design=eagle3 (experiment=eagle3), or drop draft.fc_norm")
NORM_OUTPUT_NEEDS_EAGLE3 = ("draft.norm_output (EAGLE-3.1's normalised output fed back) is an option of EAGLE-3 "
                            "heads: set draft.design=eagle3 (experiment=eagle3), or drop draft.norm_output")


def build_module(cfg: DictConfig, target, data, taps: tuple[int, ...] = ()):
    """The head (random, seeded; over a reduced vocabulary when draft.vocab_size is set; reading the decoder
    layers `taps` where given) in its module."""
    from eagle_lite.heads.draft import DraftHead

    from .module import DraftLightningModule, OptimConfig

    if cfg.draft.get("kind", "eagle") == "medusa":  # Medusa heads on the same features (conf/draft/medusa.yaml)
        from eagle_lite.heads.medusa import MedusaHeads

        from .medusa_module import MedusaLightningModule, MedusaObjectiveConfig
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            heads = MedusaHeads.for_target(target, int(cfg.draft.num_heads), int(cfg.draft.num_layers)).float()
        return MedusaLightningModule(heads, target.lm_head.weight, _typed(MedusaObjectiveConfig, cfg.draft.objective),
                                     _typed(OptimConfig, cfg.draft.optim))

    from .objective import ObjectiveConfig
    from .vocab import build_d2t, count_tokens, special_ids

    init_from = cfg.draft.get("init_from")
    fc_bias, input_norm = cfg.draft.get("fc_bias"), cfg.draft.get("input_norm")   # null: as the head started from
    fc_norm, norm_output = cfg.draft.get("fc_norm"), cfg.draft.get("norm_output")
    revocab = bool(cfg.draft.get("revocab"))
    if revocab and not init_from:
        raise ValueError(REVOCAB_NEEDS_INIT)
    if init_from:  # fine-tune an exported head: its weights and (unless draft.revocab) its draft vocabulary
        head = warm_start_head(init_from, target, None if revocab else cfg.draft.vocab_size)
        if revocab:
            head = revocabulary(head, target, data, cfg.draft.vocab_size)
        head = served_layout(head, target, data, head.fc_bias if fc_bias is None else bool(fc_bias),
                             head.input_norm if input_norm is None else bool(input_norm))
        head = normed_taps_layout(head, target, data, fc_norm)
        if norm_output is not None and bool(norm_output) != head.norm_output:
            if head.design != "eagle3":
                raise ValueError(NORM_OUTPUT_NEEDS_EAGLE3)
            head.norm_output = bool(norm_output)   # what later draft steps read; no weight changes
            log.info("draft.norm_output=%s: later draft steps read the head's output %s its final norm",
                     head.norm_output, "after" if head.norm_output else "before")
    else:
        d2t = None
        if cfg.draft.vocab_size is not None and int(cfg.draft.vocab_size) >= target.vocab_size:
            log.warning("draft.vocab_size=%s is not below the target's vocabulary (%d): the head keeps it whole",
                        cfg.draft.vocab_size, target.vocab_size)
        elif cfg.draft.vocab_size is not None:
            counts = count_tokens(data.caches, data.train_rows, target.vocab_size)
            d2t = build_d2t(counts, int(cfg.draft.vocab_size), special_ids(target))
        design = cfg.draft.get("design", "eagle")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            # fp32 master weights whatever the target's dtype
            head = DraftHead.for_target(target, d2t, feature_layers=taps, design=design,
                                        fc_bias=True if fc_bias is None else bool(fc_bias),
                                        input_norm=True if input_norm is None else bool(input_norm),
                                        fc_norm=bool(fc_norm), norm_output=bool(norm_output)).float()
        if design == "eagle3":   # its own lm_head starts as the target's rows (official EAGLE-3: at random)
            with torch.no_grad():
                rows = target.lm_head.weight if d2t is None else target.lm_head.weight[d2t]
                head.lm_head.weight.copy_(rows.float())
    parallel = cfg.draft.get("parallel")
    if parallel is not None and int(parallel) != head.parallel:
        head.make_parallel(int(parallel))         # its mask rows' two vectors, learned with the rest
    if head.parallel and int(cfg.draft.objective.ttt_steps) != head.parallel:
        raise ValueError(f"a head drafting {head.parallel} tokens a forward (draft.parallel) trains each of its rows: "
                         f"set draft.objective.ttt_steps={head.parallel} (it is "
                         f"{cfg.draft.objective.ttt_steps})")
    groups = getattr(data, "groups", ())
    module = DraftLightningModule(head, target.lm_head.weight, target.embed_tokens.weight,
                                  _typed(ObjectiveConfig, cfg.draft.objective), _typed(OptimConfig, cfg.draft.optim),
                                  val_groups=groups if len(groups) > 1 else ())
    module.online = getattr(data, "online_features", None)   # data.features.mode=online
    return module


def warm_start_head(path, target, vocab_size):
    """The exported head at `path` (checked against `target` like any head load) as fp32 weights to train on.

    Its draft vocabulary comes with it: the rows of its output layer belong to those tokens, so a
    `draft.vocab_size` that disagrees is reported and ignored rather than re-chosen from the new data.
    """
    from eagle_lite.formats import load_head

    head = load_head(path, target).float().train()
    head.tree = None  # a tree recommended for the old weights says nothing about the new ones
    kept = head.draft_vocab_size or target.vocab_size  # None: the head scores the whole vocabulary
    if vocab_size is not None and kept != min(int(vocab_size), target.vocab_size):
        log.warning("draft.init_from=%s has a draft vocabulary of %s tokens; draft.vocab_size=%s is ignored",
                    path, kept, vocab_size)
    log.info("draft.init_from: starting from the weights of %s", path)
    return head


def revocabulary(head, target, data, vocab_size):
    """`head` with its draft vocabulary re-chosen from this run's training answers (`draft.revocab`): the
    `vocab_size` most frequent (null: as many as it has now) plus the special tokens, its rows carried over where
    it had the token (trainers/vocab.py `with_draft_vocab`)."""
    from .vocab import build_d2t, count_tokens, special_ids, with_draft_vocab

    size = int(vocab_size) if vocab_size is not None else head.draft_vocab_size
    if size is None or size >= target.vocab_size:
        log.info("draft.revocab: the head scores the target's whole vocabulary; nothing to re-choose")
        return head
    counts = count_tokens(data.caches, data.train_rows, target.vocab_size)
    d2t = build_d2t(counts, size, special_ids(target))
    before = head.d2t
    head, added = with_draft_vocab(head, d2t, target.lm_head.weight)
    covered = lambda ids: float(counts[ids].sum()) / max(float(counts.sum()), 1.0)   # noqa: E731
    log.info("draft.revocab: %d of %d draft tokens are new; the draft vocabulary covers %.3f of the training "
             "answers' tokens (%.3f before)", added, size, covered(d2t),
             covered(before) if before is not None else 1.0)
    return head


def served_layout(head, target, data, fc_bias: bool, input_norm: bool):
    """`head` in the layout asked for (draft.fc_bias, draft.input_norm: trainers/relayout.py), the input norm folded
    at the mean RMS of its fc output over the first training batch."""
    from .relayout import fc_rms, relayout

    if (fc_bias, input_norm) == (head.fc_bias, head.input_norm):
        return head
    rms = None
    if head.input_norm and not input_norm:
        pairs, rows = sample_pairs(target, data)
        rms = fc_rms(head, pairs.hidden[rows][:4096], pairs.embeds[rows][:4096])
    return relayout(head, target, fc_bias, input_norm, rms)


def sample_pairs(target, data, taps: bool = False):
    """The first training batch's pairs (`objective.make_pairs`; taps: the tapped layers as the head's input) and
    the rows to sample them by: the weighted ones, else every pair inside a sequence. What a layout change measures
    the head's inputs on (`served_layout`, `normed_taps_layout`)."""
    from .objective import make_pairs

    batch = next(iter(data.train_dataloader()))
    if isinstance(batch, list):   # online features: the target computes them now
        batch = data.online_features(batch, target.device)
    pairs = make_pairs(batch, target.embed_tokens.weight.detach().float(), taps=taps)
    return pairs, pairs.weight if bool(pairs.weight.any()) else pairs.segment > 0


def normed_taps_layout(head, target, data, fc_norm: bool | None):
    """`head` with EAGLE-3.1's norm of each tapped layer where draft.fc_norm asks for it (null: as the head has it),
    each norm starting at its tap's mean RMS over the first training batch (trainers/relayout.py `with_fc_norm`)."""
    from .relayout import tap_rms, with_fc_norm

    if fc_norm is None or bool(fc_norm) == (head.fc_norm is not None):
        return head
    if not fc_norm:
        raise ValueError("draft.fc_norm=false: the head of draft.init_from normalises its taps before fc "
                         "(EAGLE-3.1) and was trained so; leave draft.fc_norm null to keep it")
    if head.design != "eagle3":
        raise ValueError(FC_NORM_NEEDS_EAGLE3)
    pairs, rows = sample_pairs(target, data, taps=True)
    return with_fc_norm(head, target, tap_rms(pairs.hidden[rows][:4096], len(head.feature_layers)))


class EarlyStop(NamedTuple):
    monitor: str = "val/accept_len_est"   # a val/* metric the module logs
    mode: str = "max"                     # max | min
    patience: int = 3                     # epochs without improvement before stopping
    min_delta: float = 0.0                # smaller changes are no improvement


def early_stop_of(cfg: DictConfig) -> EarlyStop | None:
    """cfg.early_stopping as checked settings, or None (off: null, or fast_dev_run)."""
    node = cfg.get("early_stopping")
    if not node or cfg.trainer.get("fast_dev_run"):
        return None
    if not isinstance(node, (DictConfig, dict)):
        raise ValueError(f"early_stopping must be null or a mapping such as {{monitor: val/accept_len_est, mode: max, "
                         f"patience: 3, min_delta: 0.002}}, got {node!r}")
    values = _container(node)
    unknown = set(values) - set(EarlyStop._fields)
    if unknown:
        raise ValueError(f"early_stopping has unknown keys {sorted(unknown)}: use {', '.join(EarlyStop._fields)}")
    stop = EarlyStop(**values)
    if stop.mode not in ("max", "min") or stop.patience < 1 or stop.min_delta < 0:
        raise ValueError(f"early_stopping needs mode max or min, patience >= 1 and min_delta >= 0, got {values}")
    if not str(stop.monitor).startswith(("val/", "val_kind/")):   # else Lightning finds out after an epoch
        raise ValueError(f"early_stopping.monitor must be a validation metric (val/accept_len_est, val/loss, "
                         f"val/top1, ...), got {stop.monitor!r}")
    return stop


def fit(cfg: DictConfig, module, data):
    """Stage 3: Lightning fit, resumed from <output>/checkpoints/last.ckpt when present and cfg.resume. With
    early_stopping, the module ends up with the weights of its best validation epoch (checkpoints/best.ckpt)."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from .loggers import build_logger
    from .report import History
    from .run_folder import AtomicCheckpointIO, resume_checkpoint

    output = Path(cfg.paths.output)
    ckpt_dir = output / "checkpoints"
    history = History(output / "epochs.json")   # the rows of finished epochs survive a kill
    callbacks: list = [history]
    stop, best = early_stop_of(cfg), None
    if not cfg.trainer.get("fast_dev_run"):
        # last.ckpt: every N steps, when an exception stops the run, and at the end of training
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, save_on_exception=True,
                                         every_n_train_steps=cfg.checkpoint.every_n_train_steps))
    if stop is not None:
        callbacks.append(EarlyStopping(monitor=stop.monitor, mode=stop.mode, patience=stop.patience,
                                       min_delta=stop.min_delta, check_finite=True))
        best = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor=stop.monitor, mode=stop.mode, save_top_k=1,
                               auto_insert_metric_name=False, enable_version_counter=False)
        callbacks.append(best)
    bar = {} if cfg.progress else {"enable_progress_bar": False}   # progress=false: no bar anywhere
    trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, plugins=[AtomicCheckpointIO()],
                                      logger=build_logger(cfg) or False, default_root_dir=str(output), **bar)
    found = resume_checkpoint(ckpt_dir) if cfg.resume else None   # a damaged one is set aside
    resume_from = str(found) if found else None
    if resume_from:
        log.info("resuming from %s", resume_from)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # Lightning looks for resumable dataloaders only; our datamodule's state resumes the data order mid-epoch
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        # online features (trainers/online.py) are computed in the module's hook, by design
        warnings.filterwarnings("ignore", message="You have overridden `on_after_batch_transfer` in `LightningModule`")
        # Lightning's own use of torch's pytree API, deprecated by torch: nothing a user's run can change
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        try:
            # Our own checkpoint (a pickle we wrote), read with torch's restricted weights_only unpickler.
            trainer.fit(module, datamodule=data, ckpt_path=resume_from, weights_only=True)
        except SystemExit:
            # Lightning ends a fit stopped by Ctrl-C (its checkpoint saved) with sys.exit(1): it is an interrupt
            if not trainer.interrupted:
                raise
            import signal

            signal.signal(signal.SIGINT, signal.default_int_handler)   # Lightning ignores a second Ctrl-C
            raise (history.exception if isinstance(history.exception, KeyboardInterrupt)
                   else KeyboardInterrupt()) from None
    history.fit_seconds = round(time.perf_counter() - t0, 1)
    if not cfg.trainer.get("fast_dev_run") and trainer.global_step != (history.start_step or 0):
        # the end of training as last.ckpt (the periodic one may be a few steps short): a rerun that raises
        # max_epochs trains on from here, not from the last multiple of every_n_train_steps
        trainer.save_checkpoint(ckpt_dir / "last.ckpt", weights_only=False)
    if best is not None and best.best_model_path and Path(best.best_model_path).is_file():
        # our own checkpoint, read with torch's restricted unpickler; the frozen buffers are not in it
        state = torch.load(best.best_model_path, map_location="cpu", weights_only=True)
        if not sharded(trainer):   # FSDP: run_stages exports from the checkpoint (`whole_module`)
            module.load_state_dict(state["state_dict"])
        history.best = {"monitor": stop.monitor, "value": round(float(best.best_model_score), 5),
                        "epoch": int(state["epoch"]), "step": int(state["global_step"])}
        log.info("early_stopping: exporting epoch %d (%s %.4f)", history.best["epoch"], stop.monitor,
                 history.best["value"])
    return trainer, history, resume_from


def sharded(trainer) -> bool:
    """Whether the module's parameters are each rank's shards (FSDP), not the whole weights."""
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(trainer.strategy, FSDPStrategy)


def whole_module(cfg: DictConfig, target, data, taps: tuple[int, ...], checkpoint: Path):
    """After an FSDP fit, the module with the whole weights of `checkpoint` (state_dict_type: full), for the export:
    the fitted module's own parameters are this rank's shards."""
    module = build_module(cfg, target, data, taps)
    # our own checkpoint, read with torch's restricted unpickler
    module.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"])
    return module


def check_run_folder(cfg: DictConfig) -> None:
    """Refuse to resume into a run folder whose exported head is of the other kind (EAGLE vs Medusa).

    `draft=medusa` without `experiment=medusa` keeps name=default: it must neither continue nor overwrite
    the EAGLE head's run.
    """
    from eagle_lite.heads.checkpoint import FORMAT, KINDS, MEDUSA_FORMAT

    expected = MEDUSA_FORMAT if cfg.draft.get("kind", "eagle") == "medusa" else FORMAT
    exported = Path(cfg.paths.export) / "config.json"
    if not (cfg.resume and exported.is_file()):
        return
    try:
        found = json.loads(exported.read_text()).get("format")
    except (ValueError, AttributeError):
        return  # unreadable: the export is rewritten anyway
    if found != expected:
        raise ValueError(f"run folder {cfg.paths.output} holds {KINDS.get(found, repr(found))}, but this run trains "
                         f"{KINDS[expected]}: give it its own folder (experiment=medusa, or name=...)")


def check_settings(cfg: DictConfig) -> str | None:
    """Refuse, before the target loads, the run settings no training can take; returns the stage to stop after."""
    stop_after = cfg.get("stop_after") or ("features" if cfg.get("data_only", False) else None)
    if stop_after not in (None, "distill", "features"):
        raise ValueError(f"stop_after must be distill, features or null (every stage), got {stop_after!r}")
    check_whole("seed", cfg.seed, 0, 1 << 32)   # Lightning's seed_everything takes an unsigned 32-bit seed
    trainer = cfg.trainer
    fast = trainer.get("fast_dev_run")
    if isinstance(fast, bool) or fast is None:
        if not fast:
            check_whole("trainer.max_epochs", trainer.get("max_epochs"), 1)
            steps = check_whole("trainer.max_steps", trainer.get("max_steps", -1), -1)
            if steps == 0:
                raise ValueError("trainer.max_steps must be >= 1 (or -1: no limit), got 0")
    else:
        check_whole("trainer.fast_dev_run", fast, 1)
    check_whole("checkpoint.every_n_train_steps", cfg.checkpoint.every_n_train_steps, 1)
    # the settings of each stage this run reaches, so that a typo is not found after the answers are written
    from .datamodule import LoaderConfig
    from .distill import DistillConfig
    from .features import FeatureConfig
    from .targets import TargetConfig

    _typed(TargetConfig, cfg.target)
    for source in data_sources(cfg):
        _typed(DistillConfig, source.settings)
    if stop_after != "distill":
        features = _typed(FeatureConfig, cfg.data.features)
        if features.mode == "online" and cfg.draft.get("kind", "eagle") == "medusa":
            raise ValueError("data.features.mode=online trains EAGLE heads; Medusa heads read the feature cache "
                             "(data.features.mode=cached)")
    if stop_after is None:
        from .loggers import check_logger

        _typed(LoaderConfig, cfg.data.loader)
        check_logger(cfg)
        early_stop_of(cfg)
        check_draft_settings(cfg)
    return stop_after


def check_draft_settings(cfg: DictConfig) -> None:
    """The fitting stage's objective, optimiser and draft vocabulary settings, refused before any data stage runs."""
    from .module import OptimConfig

    if cfg.draft.get("kind", "eagle") == "medusa":
        from .medusa_module import MedusaObjectiveConfig
        _typed(MedusaObjectiveConfig, cfg.draft.objective)
    else:
        from .objective import ObjectiveConfig
        _typed(ObjectiveConfig, cfg.draft.objective)
        if cfg.draft.get("revocab") and not cfg.draft.get("init_from"):
            raise ValueError(REVOCAB_NEEDS_INIT)
        new_eagle1 = not cfg.draft.get("init_from") and cfg.draft.get("design", "eagle") != "eagle3"
        if cfg.draft.get("fc_norm") and new_eagle1:
            raise ValueError(FC_NORM_NEEDS_EAGLE3)
        if cfg.draft.get("norm_output") and new_eagle1:
            raise ValueError(NORM_OUTPUT_NEEDS_EAGLE3)
    _typed(OptimConfig, cfg.draft.optim)


def train(cfg: DictConfig) -> dict:
    """Run every stage for `cfg` (the composed `conf/train.yaml`); returns the run's summary. A run whose training
    completed with these stop settings returns {"finished": ...} and leaves its exported head alone. One training
    at a time per run folder (`run_folder.RunLock`)."""
    from .run_folder import RunLock, finished

    stop_after = check_settings(cfg)
    check_run_folder(cfg)
    ranks = rank_of(cfg)
    join(ranks, str(cfg.trainer.get("accelerator", "cpu")))
    if not ranks.zero:   # rank 0 holds the lock and says whether the run has finished already
        done = ranks.broadcast(None)
        return done if done is not None else run_stages(cfg, stop_after, ranks)
    with RunLock(cfg.paths.output):
        done = finished(cfg) if stop_after is None else None
        if done is not None:
            done = {"experiment": cfg.name, "finished": True, "export": done["export"],
                    "global_step": done["global_step"], "resumed_from_step": done["global_step"],
                    "epochs": done["epochs"], "output": str(cfg.paths.output)}
        ranks.broadcast(done)
        return done if done is not None else run_stages(cfg, stop_after, ranks)


def rank_of(cfg: DictConfig) -> Ranks:
    """This process's place among the ranks of the run (`trainers.ranks`)."""
    return current(int(cfg.trainer.get("num_nodes") or 1))


def run_stages(cfg: DictConfig, stop_after: str | None, ranks: Ranks = Ranks()) -> dict:
    """The stages of `train`, up to `stop_after` (None: all four)."""
    import lightning.pytorch as L

    from eagle_lite.heads.checkpoint import save_head
    from eagle_lite.heads.medusa import save_medusa

    from .estimate import announce
    from .features import describe_bytes
    from .loggers import one_copy_of_lightning_lines
    from .report import folder_bytes, plot_training_curve, write_train_log
    from .run_folder import mark_finished
    from .targets import TargetConfig, build_target

    one_copy_of_lightning_lines()
    start = time.perf_counter()
    L.seed_everything(cfg.seed, workers=True)
    settings = _typed(TargetConfig, cfg.target)
    target = build_target(dataclasses.replace(settings, device=ranks.device(settings.device)))
    sources = data_sources(cfg)
    taps = feature_layers(cfg, target)
    estimated = announce(cfg, target, sources, taps) if cfg.get("estimate", True) and ranks.zero else None
    if stop_after == "distill":
        return {**distill_only(cfg, target, sources, ranks), "seconds": round(time.perf_counter() - start, 1)}
    seconds, manifest, data = prepare_data(cfg, target, sources, taps, ranks)
    if stop_after == "features":
        log.info("stop_after=features: %d sequences, %d tokens ready in %s; rerun without it to fit",
                 manifest["total_sequences"], manifest["total_tokens"], ", ".join(str(s.features) for s in sources))
        return {"experiment": cfg.name, "sequences": manifest["total_sequences"], "stage": "features",
                "tokens": manifest["total_tokens"], **seconds, "seconds": round(time.perf_counter() - start, 1)}
    module = build_module(cfg, target, data, taps)
    trainer, history, resume_from = fit(cfg, module, data)
    if resume_from and trainer.global_step == history.start_step and (Path(cfg.paths.export) / "config.json").is_file():
        # the checkpoint was already at the end (a run finished before finished.json was kept): its head stays
        summary = {"global_step": trainer.global_step, "epochs": trainer.current_epoch}
        mark_finished(cfg, summary)
        return {"experiment": cfg.name, "finished": True, "export": str(cfg.paths.export),
                "resumed_from_step": trainer.global_step, "output": str(cfg.paths.output), **summary}

    # 4. export
    paths, export = cfg.paths, Path(cfg.paths.export)
    if trainer.is_global_zero and sharded(trainer):
        ckpt_dir = Path(paths.output) / "checkpoints"
        module = whole_module(cfg, target, data, taps, ckpt_dir / ("best.ckpt" if history.best else "last.ckpt"))
    metrics = {k: round(float(v), 5) for k, v in trainer.callback_metrics.items()
               if k.startswith("val/") or k.endswith("_epoch")}
    summary = {
        "experiment": cfg.name, "target": target.name, "global_step": trainer.global_step,
        "resumed_from_step": history.start_step, "epochs": trainer.current_epoch,
        "sequences": manifest["total_sequences"], "tokens": manifest["total_tokens"],
        "draft_vocab_size": getattr(module.head, "draft_vocab_size", None),  # None for Medusa heads
        "head_kind": "medusa" if cfg.draft.get("kind", "eagle") == "medusa" else module.head.design,
        "val_sequences": len(data.val_rows) if data.val_rows is not None else None,
        "estimated_seconds": estimated["seconds"] if estimated else None,
        "seconds": round(time.perf_counter() - start, 1),
        **seconds, "seconds_fit": history.fit_seconds,
        "disk_distill": describe_bytes(sum(folder_bytes(s.distill) for s in sources)),
        "disk_features": describe_bytes(sum(folder_bytes(s.features) for s in sources)),
        "disk_checkpoints": describe_bytes(folder_bytes(Path(paths.output) / "checkpoints")),
        **metrics,
    }
    if history.best is not None:   # the exported weights are the best epoch's: so are the metrics reported
        row = next((r for r in history.epochs if r["epoch"] == history.best["epoch"]), {})
        metrics.update({k: v for k, v in row.items() if k.startswith("val/")})
        summary.update({k: v for k, v in row.items() if k.startswith("val/")}, best_epoch=history.best["epoch"],
                       best_step=history.best["step"], stopped_epoch=trainer.current_epoch)
    epochs = history.epochs   # with the epochs of the runs this one continued
    if trainer.is_global_zero:
        save = save_medusa if cfg.draft.get("kind", "eagle") == "medusa" else save_head
        training = {k: summary[k] for k in ("experiment", "global_step", "sequences", "tokens")} | metrics
        if cfg.draft.get("init_from"):  # a fine-tuned head says what it started from, and how that was trained
            from eagle_lite.heads.checkpoint import read_head_config

            training["init_from"] = {"path": str(cfg.draft.init_from),
                                     **read_head_config(cfg.draft.init_from).get("training", {})}
        save(module.head, export, target, extra={"training": training})
        write_text_atomic(export / "train_config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        write_train_log(export, summary, epochs)
        plot_training_curve(export / "training_curve.png", epochs, summary.get("best_epoch"))
        log.info("exported the head to %s", export)
        if estimated:
            summary["decode_step_s"] = estimated["probe"]["decode_step_s"]
        if not cfg.trainer.get("fast_dev_run"):
            summary["tune"] = tuned_tree(cfg, summary["head_kind"], export, target.device.type)
            mark_finished(cfg, summary)
    return {**summary, "export": str(export), "epochs_log": epochs}


def tuned_tree(cfg: DictConfig, head_kind: str, export: Path, device: str) -> dict | None:
    """The new head's CPU tree, tuned and saved in its config.json (trainers/tree_tune.py), or what to run for it:
    None where there is nothing to tune (a tiny in-process target, a Medusa head, a GPU run, tune_tree=false)."""
    from .tree_tune import command, tune_tree

    if cfg.target.kind != "pretrained" or head_kind == "medusa" or device != "cpu":
        return None
    # the tune decodes as a user's process does (one thread per core), whatever threads the training ran on
    if not cfg.get("tune_tree", True):
        return {"command": command(str(export), cfg.target.spec, None), "tree": None}
    log.info("tuning the head's CPU tree on a few held-out prompts (tune_tree=false skips it)")
    try:
        return tune_tree(cfg.target.spec, export)
    except Exception as err:   # noqa: BLE001 - the head is exported; the summary names the command to run instead
        log.warning("the tree tune failed (%s); the summary names its command", one_line(err))
        return {"command": command(str(export), cfg.target.spec, None), "tree": None, "error": one_line(err)}


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    zero = rank_of(cfg).zero   # before the fit: Lightning's teardown clears WORLD_SIZE
    result = train(cfg)
    if not zero:   # rank 0 says what the run did
        return
    if result.get("finished"):
        print(f"run {result['output']} has finished (step {result['global_step']}; head in {result['export']}): "
              f"nothing to do. Raise trainer.max_epochs or trainer.max_steps to train on, or give name=... for a "
              f"new run")
        return
    if "export" not in result:
        ready = "answers" if result["stage"] == "distill" else "features"
        made = (f"; {result['new_tokens']} answer tokens written now at {result['new_tokens_per_s']} tokens/s"
                if result.get("new_tokens") else "")
        stage = f"; features {result['seconds_features']} s" if "seconds_features" in result else ""
        print(f"{ready} ready: {result['sequences']} sequences, {result['tokens']} tokens "
              f"({result['seconds']} s{stage}){made}")
        return
    from .next_steps import closing

    print(closing(result, cfg.target.spec if cfg.target.kind == "pretrained" else None))


if __name__ == "__main__":
    sys.argv[1:] = own_target(sys.argv[1:])
    sys.exit(hydra_entry(main, stopped="[stopped] finished work is kept: run the same command again to resume"))
