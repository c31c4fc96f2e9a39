"""The feature cache: the target's last hidden states over every distilled sequence, computed once.

Training the head never runs the target: it reads, per sequence, the token ids, the loss mask (1 on
target-written tokens) and the features f_0..f_{T-1} (`last_hidden_state`, after the final norm,
stored in bf16). Layout of a cache folder:

  shard-00000.safetensors   input_ids int32 [N], loss_mask bool [N], hidden bf16 [N, H],
                            offsets int64 [S + 1] (sequence i is rows offsets[i]:offsets[i + 1]),
                            and for EAGLE-3 heads taps bf16 [N, K * H]: the outputs of the K decoder
                            layers `feature_layers` (the head's input; `hidden` stays its target)
  manifest.json             target fingerprint, dtype, hidden size, max_len, and per shard its file,
                            record ids, token count, size in bytes and checksum (trainers/shards.py);
                            totals; `complete`

Shard k always holds records k*shard_size ... (k+1)*shard_size - 1 of the distilled data, so a rerun
keeps every shard whose recorded ids still match and computes only the rest.

Over several processes (`trainers.ranks`: torchrun, SLURM) rank r of w computes the missing shards k with
k % w == r, each into its own shard file; rank 0 writes the manifest, complete, once every rank has passed the
barrier after its share. A shard file the manifest does not record yet (its rank, or the whole run, died before the
manifest was written) is taken up on the next run when its header's record ids are the shard's: a rerun, on any
number of processes, computes only the shards no file holds. Shards and the manifest
are written atomically (the manifest after every shard), so an interrupted run resumes where it stopped;
a shard whose file no longer matches its recorded size and checksum (truncated, overwritten, deleted) is
computed again, with a log line naming it. Manifests written before sizes and checksums were recorded keep
working: their shards are checked by reading their safetensors header, then recorded.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from eagle_lite.atomic import write_atomic, write_json_atomic
from eagle_lite.targets.model import Target

from .ranks import Ranks
from .shards import file_damage, file_digest
from .targets import pad_token_id

log = logging.getLogger("trainers.features")

FORMAT = "eagle_lite.features"
MANIFEST = "manifest.json"
_FINGERPRINT_KEYS = ("model_type", "hidden_size", "vocab_size", "embedding_sha")
_BYTES_PER_TOKEN_EXTRA = 4 + 1  # int32 id + bool mask, next to the 2 * H bytes of bf16 features


class FeatureCacheMismatch(ValueError):
    """The cache was built for another target or with other settings."""


@dataclass(frozen=True)
class FeatureConfig:
    max_len: int = 1024       # sequences are cut to their first max_len tokens
    shard_size: int = 256     # sequences per shard file (the unit of resumption)
    batch_size: int = 4       # sequences per target forward
    space_margin: float = 1.1  # refuse to start unless this times the estimate is free
    feature_layers: tuple[int, ...] = ()  # also store these decoder layers' outputs (EAGLE-3 heads read them)
    mode: str = "cached"      # cached: this stage writes the cache, the fit reads it; online: the fit's target
                              # computes each batch's features (trainers/online.py) and this stage writes nothing

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers or ()))
        if self.mode not in ("cached", "online"):
            raise ValueError(f"data.features.mode must be cached or online, got {self.mode!r}")
        for key in ("max_len", "shard_size", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.features.{key} must be >= 1, got {getattr(self, key)}")


def loss_mask_of(record: dict, max_len: int) -> tuple[list[int], list[bool]]:
    """(input_ids, loss_mask) of a distilled record, cut to max_len; mask is True inside its spans."""
    ids = record["input_ids"][:max_len]
    mask = [False] * len(ids)
    for start, end in record["spans"]:
        for t in range(start, min(end, len(ids))):
            mask[t] = True
    return ids, mask


def estimate_bytes(tokens: int, hidden_size: int, taps: int = 0) -> int:
    return tokens * (2 * hidden_size * (1 + taps) + _BYTES_PER_TOKEN_EXTRA)


def describe_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_fingerprint(built: dict, given: dict, folder: Path | str) -> None:
    if any(built.get(k) != given.get(k) for k in _FINGERPRINT_KEYS):
        raise FeatureCacheMismatch(
            f"feature cache {folder} was built for target {built}, but the target now is {given}; "
            f"features of different targets cannot be mixed: use another folder (paths.data) or delete {folder}"
        )


@torch.inference_mode()
def target_features(target: Target, sequences: Sequence[Sequence[int]],
                    taps: tuple[int, ...] = ()) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
    """One batched forward (right padding, no KV cache): the last hidden states [T_i, H] of each sequence;
    with `taps`, pairs (hidden [T_i, H], the taps' outputs concatenated [T_i, len(taps) * H])."""
    pad = pad_token_id(target)
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)  # B T
    attention = torch.zeros_like(ids)
    for r, seq in enumerate(sequences):
        ids[r, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[r, :len(seq)] = 1
    with target.stock():   # the model as built, whether or not distillation sped it up in this process
        out = target.decoder(input_ids=ids.to(target.device), attention_mask=attention.to(target.device),
                             use_cache=False, output_hidden_states=bool(taps))
    hidden = out.last_hidden_state  # B T H; causal, so right padding never changes the real positions
    if not taps:
        return [hidden[r, :len(seq)] for r, seq in enumerate(sequences)]
    tapped = torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1)  # B T K*H ([i + 1]: layer i's output)
    return [(hidden[r, :len(seq)], tapped[r, :len(seq)]) for r, seq in enumerate(sequences)]


def _write_shard(target: Target, path: Path, chunk: list[dict], cfg: FeatureConfig, settings: str,
                 bar=None) -> dict:
    pairs = [loss_mask_of(r, cfg.max_len) for r in chunk]
    hidden: list[torch.Tensor | None] = [None] * len(chunk)
    taps: list[torch.Tensor | None] = [None] * len(chunk)
    order = sorted(range(len(chunk)), key=lambda i: len(pairs[i][0]))  # similar lengths batch together
    for start in range(0, len(order), cfg.batch_size):
        rows = order[start:start + cfg.batch_size]
        for i, out in zip(rows, target_features(target, [pairs[i][0] for i in rows], cfg.feature_layers)):
            if cfg.feature_layers:
                out, tapped = out
                taps[i] = tapped.to("cpu", torch.bfloat16)
            hidden[i] = out.to("cpu", torch.bfloat16)
        if bar is not None:
            bar.update(len(rows))
    lengths = torch.tensor([len(ids) for ids, _ in pairs])
    tensors = {
        "input_ids": torch.tensor([t for ids, _ in pairs for t in ids], dtype=torch.int32),        # N
        "loss_mask": torch.tensor([m for _, mask in pairs for m in mask], dtype=torch.bool),      # N
        "hidden": torch.cat(hidden).contiguous(),                                                  # N H
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),             # S+1
    }
    if cfg.feature_layers:
        tensors["taps"] = torch.cat(taps).contiguous()                                             # N K*H
    ids = [r["id"] for r in chunk]
    write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT, "ids": json.dumps(ids),
                                                                         "settings": settings}))
    return {"file": path.name, "ids": ids, "sequences": len(chunk), "tokens": int(lengths.sum()), **file_digest(path)}


def shard_damage(path: Path, entry: dict) -> str | None:
    """Why the shard file of manifest `entry` cannot be kept (None: it can). A shard recorded without a size and
    checksum (an older manifest) is kept when its safetensors header reads and fits the file."""
    problem = file_damage(path, entry)
    if problem is not None or "blake2b" in entry:
        return problem
    try:
        safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        return f"unreadable: {err}"
    return None


def _read_manifest(path: Path) -> dict | None:
    """The manifest at `path`, or None (with a warning) where it is damaged: the shards are then all computed
    again, as for a new folder."""
    try:
        manifest = json.loads(path.read_text())
        if all(key in manifest for key in ("target", "max_len", "shard_size", "shards")):
            return manifest
    except (ValueError, OSError):
        pass
    log.warning("features: %s is damaged; computing every shard again", path)
    return None


def shard_settings(fingerprint: dict, cfg: FeatureConfig) -> str:
    """What a shard file's header records of how it was computed, so that a shard no manifest names yet is taken
    up only by a run of the same target and settings."""
    return json.dumps({"target": fingerprint, "max_len": cfg.max_len, "feature_layers": list(cfg.feature_layers)},
                      sort_keys=True)


def unrecorded_shard(folder: Path, k: int, ids: list[str], settings: str) -> dict | None:
    """The manifest entry of shard file k where it exists unrecorded (written by a rank that died, or before the
    manifest that would have named it) and its header says it holds the records `ids`, computed with `settings`
    (`shard_settings`); else None."""
    path = folder / f"shard-{k:05d}.safetensors"
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("settings") != settings or json.loads(meta["ids"]) != ids:
                return None
            tokens = int(handle.get_tensor("offsets")[-1])
    except (SafetensorError, OSError, KeyError, ValueError):
        return None
    return {"index": k, "file": path.name, "ids": ids, "sequences": len(ids), "tokens": tokens, **file_digest(path)}


def reusable_shards(folder: Path, entries: dict[int, dict], chunks: list[list[dict]],
                    settings: str | None = None) -> set[int]:
    """The indices of the shards in `entries` to keep: the same records, and a file that is not damaged (a
    damaged one is logged by name). Entries of older manifests gain their file's size and checksum here; a shard
    file no entry names is taken up where its header holds the shard's records computed with `settings`
    (`unrecorded_shard`; None: none is)."""
    kept = set()
    for k, chunk in enumerate(chunks):
        entry = entries.get(k)
        if entry is None or entry["ids"] != [r["id"] for r in chunk]:
            found = None if settings is None else unrecorded_shard(folder, k, [r["id"] for r in chunk], settings)
            if found is None:
                continue
            entries[k] = entry = found
        path = folder / entry["file"]
        problem = shard_damage(path, entry)
        if problem is not None:
            log.warning("features: shard %s is damaged (%s); computing it again", path, problem)
            continue
        if "blake2b" not in entry:
            entries[k] = {**entry, **file_digest(path)}
        kept.add(k)
    return kept


def cache_features(target: Target, records: Sequence[dict], folder: str | Path, cfg: FeatureConfig,
                   progress: bool = True, ranks: Ranks = Ranks()) -> dict:
    """Compute the shards of `records` (distilled, in order) not yet in `folder`; returns the manifest. ranks: this
    process's share where several compute the cache together (the module doc)."""
    folder = Path(folder)
    if ranks.spawned:   # Lightning started this rank inside the fit: rank 0 finished the cache before
        return FeatureCache(folder).manifest
    shared = ranks.world > 1
    folder.mkdir(parents=True, exist_ok=True)
    fingerprint = target.fingerprint()
    manifest_path = folder / MANIFEST
    entries: dict[int, dict] = {}
    old = _read_manifest(manifest_path) if manifest_path.is_file() else None
    if old is not None:
        check_fingerprint(old["target"], fingerprint, folder)
        for key in ("max_len", "shard_size"):
            if old[key] != getattr(cfg, key):
                raise FeatureCacheMismatch(
                    f"feature cache {folder} was built with {key}={old[key]}, now {key}={getattr(cfg, key)}; "
                    f"keep the old value, or use another folder / delete {folder} to rebuild"
                )
        held = tuple(old.get("feature_layers", []))
        if cfg.feature_layers and held != cfg.feature_layers:
            raise FeatureCacheMismatch(
                f"feature cache {folder} holds the outputs of decoder layers {list(held) or 'none'}, this head reads "
                f"{list(cfg.feature_layers)}: give each its own folder (paths.features=...)")
        if held and not cfg.feature_layers:  # a plain head reads any cache: its new shards keep the same taps
            cfg = dataclasses.replace(cfg, feature_layers=held)
        entries = {e["index"]: e for e in old["shards"]}
    chunks = [list(records[i:i + cfg.shard_size]) for i in range(0, len(records), cfg.shard_size)]
    # shards no manifest names are taken up, unless the manifest is damaged (then everything starts over)
    settings = shard_settings(fingerprint, cfg)
    adopt = settings if old is not None or not manifest_path.is_file() else None
    kept = reusable_shards(folder, entries, chunks, adopt)
    todo = [k for k in range(len(chunks)) if k not in kept]
    if shared:
        ranks.barrier()   # every rank has read the folder as it was before any of them writes to it
        mine = [k for k in todo if k % ranks.world == ranks.rank]
        log.info("features: rank %d of %d computes %d of the %d shards left", ranks.rank, ranks.world, len(mine),
                 len(todo))
        todo = mine
    need = estimate_bytes(sum(min(len(r["input_ids"]), cfg.max_len) for k in todo for r in chunks[k]),
                          target.hidden_size, len(cfg.feature_layers))
    free = shutil.disk_usage(folder).free
    log.info("features: %d of %d shards to compute, about %s on disk (%s free at %s)",
             len(todo), len(chunks), describe_bytes(need), describe_bytes(free), folder)
    if need * cfg.space_margin > free:
        raise OSError(f"the feature cache needs about {describe_bytes(need)} at {folder} but only "
                      f"{describe_bytes(free)} is free: free space, lower data.distill.limit or "
                      f"data.features.max_len, or point paths.data at a larger disk")

    todo_left = list(todo)
    started = time.perf_counter()

    def manifest() -> dict:
        kept = [entries[k] for k in sorted(entries) if k < len(chunks)]
        return {
            "format": FORMAT, "version": 1, "target": fingerprint, "dtype": "bfloat16",
            "hidden_size": target.hidden_size, "max_len": cfg.max_len, "shard_size": cfg.shard_size,
            "feature_layers": list(cfg.feature_layers),
            "shards": kept, "total_sequences": sum(e["sequences"] for e in kept),
            "total_tokens": sum(e["tokens"] for e in kept), "planned_sequences": len(records),
            "complete": len(todo_left) == 0 and len(kept) == len(chunks),
        }

    with tqdm(total=sum(len(chunks[k]) for k in todo), desc="features", unit="seq",
              disable=not progress or not todo) as bar:
        for k in todo:
            entry = _write_shard(target, folder / f"shard-{k:05d}.safetensors", chunks[k], cfg, settings, bar)
            entries[k] = {"index": k, **entry}
            todo_left.remove(k)
            if not shared:   # ranks leave the manifest to rank 0, after the barrier
                write_json_atomic(manifest_path, manifest())
    if shared:
        ranks.barrier()   # every rank's shards are written
        if not ranks.zero:
            ranks.barrier()   # rank 0 writes the manifest
            return json.loads(manifest_path.read_text())
        reusable_shards(folder, entries, chunks, settings)   # takes up the other ranks' shards
        todo_left = [k for k in range(len(chunks)) if k not in entries]
    for k in [k for k in entries if k >= len(chunks)]:  # shards of records that no longer exist
        (folder / entries.pop(k)["file"]).unlink(missing_ok=True)
    final = manifest()
    write_json_atomic(manifest_path, final)
    if shared:
        ranks.barrier()
    if todo:
        done_tokens = sum(entries[k]["tokens"] for k in todo)
        spent = time.perf_counter() - started
        log.info("features: %d sequences (%d tokens) in %.1f s, %.2f ms/token", sum(len(chunks[k]) for k in todo),
                 done_tokens, spent, 1000 * spent / max(done_tokens, 1))
    return final


class FeatureCache:
    """Read access to a complete cache folder; shard files are opened lazily (memory-mapped)."""

    def __init__(self, folder: str | Path, expect_target: dict | None = None) -> None:
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"no feature cache at {self.folder} (missing {MANIFEST}); run the features stage")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{path} is not an eagle_lite feature cache (format={self.manifest.get('format')!r})")
        if expect_target is not None:
            check_fingerprint(self.manifest["target"], expect_target, self.folder)
        if not self.manifest["complete"]:
            raise ValueError(f"feature cache {self.folder} is incomplete ({self.manifest['total_sequences']} of "
                             f"{self.manifest['planned_sequences']} sequences); rerun the features stage to finish it")
        for entry in self.manifest["shards"]:  # a stat each: a truncated shard is named here, not mid-training
            problem = file_damage(self.folder / entry["file"], entry, checksum=False)
            if problem is not None:
                raise ValueError(f"feature shard {self.folder / entry['file']} is damaged ({problem}); rerun the "
                                 f"features stage (the same training command) to compute it again")
        self._handles: dict[str, object] = {}

    def __getstate__(self) -> dict:  # DataLoader workers reopen the files themselves
        return {**self.__dict__, "_handles": {}}

    @property
    def hidden_size(self) -> int:
        return self.manifest["hidden_size"]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The decoder layers whose outputs the cache holds as `taps` besides the last hidden state (EAGLE-3)."""
        return tuple(self.manifest.get("feature_layers", []))

    def _open(self, file: str):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.folder / file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise ValueError(f"feature shard {self.folder / file} is unreadable ({err}); rerun the features "
                                 f"stage (the same training command) to compute it again") from err
        return self._handles[file]

    def index(self):
        """A `datasets.Dataset` with one row per sequence: id, file, start, length, loss_tokens."""
        import datasets

        rows: dict[str, list] = {"id": [], "file": [], "start": [], "length": [], "loss_tokens": []}
        for entry in self.manifest["shards"]:
            handle = self._open(entry["file"])
            offsets = handle.get_tensor("offsets")
            mask_sums = torch.cat([torch.zeros(1, dtype=torch.long),
                                   handle.get_tensor("loss_mask").long().cumsum(0)])
            for i, seq_id in enumerate(entry["ids"]):
                a, b = int(offsets[i]), int(offsets[i + 1])
                rows["id"].append(seq_id)
                rows["file"].append(entry["file"])
                rows["start"].append(a)
                rows["length"].append(b - a)
                rows["loss_tokens"].append(int(mask_sums[b] - mask_sums[a]))
        return datasets.Dataset.from_dict(rows)

    def read(self, file: str, start: int, length: int) -> dict[str, torch.Tensor]:
        """One sequence: input_ids long [T], loss_mask bool [T], hidden bf16 [T, H] (and taps bf16 [T, K*H] where
        the cache holds them); reads only its rows."""
        handle = self._open(file)
        end = start + length
        out = {
            "input_ids": handle.get_slice("input_ids")[start:end].long(),
            "loss_mask": handle.get_slice("loss_mask")[start:end],
            "hidden": handle.get_slice("hidden")[start:end],
        }
        if self.feature_layers:
            out["taps"] = handle.get_slice("taps")[start:end]
        return out

    def token_ids(self, file: str) -> tuple[torch.Tensor, torch.Tensor]:
        """All (input_ids [N], loss_mask [N]) of one shard."""
        handle = self._open(file)
        return handle.get_tensor("input_ids").long(), handle.get_tensor("loss_mask")
