"""Online features (`data.features.mode=online`): the target runs inside the fit, on the fit's device, and computes
each batch's features instead of reading them from the feature cache.

Nothing lands on disk (a cache of a long-context, 8B-target dataset is terabytes: SpecForge issue #466), at the cost
of one target forward a batch. The batches are those of the cached mode: the same sequences, the same random
windows, the same validation split, so the two modes train the same head up to the rounding of the features to
bf16 (what the cache stores, and what is used here too).

- `RecordCache` reads the distilled records as the datamodule reads a feature cache (`index`, `read`, `token_ids`),
  with no features: `read` returns a window with its context before it (`context`: how many tokens to drop once the
  target has read them), since a window's features depend on every token before it.
- `OnlineFeatures` is called on each batch (the module's `on_after_batch_transfer`): a list of such items in (the
  datamodule's `collate_items`), the collated batch of the cached mode out.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from .features import loss_mask_of, target_features
from .objective import collate


class RecordCache:
    """The distilled records of one folder (cut to max_len, as the features stage cuts them), read like a
    `features.FeatureCache` without features."""

    def __init__(self, records: Sequence[dict], max_len: int, folder: str | Path,
                 feature_layers: tuple[int, ...] = ()) -> None:
        self.folder = Path(folder)
        self.feature_layers = tuple(feature_layers)
        self.ids: list[str] = []
        self.tokens: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        for record in records:
            ids, mask = loss_mask_of(record, max_len)
            self.ids.append(record["id"])
            self.tokens.append(torch.tensor(ids, dtype=torch.long))
            self.masks.append(torch.tensor(mask, dtype=torch.bool))

    def index(self):
        """A `datasets.Dataset` of the records, one "file" each (its position)."""
        import datasets

        return datasets.Dataset.from_dict({
            "id": self.ids, "file": [str(i) for i in range(len(self.ids))], "start": [0] * len(self.ids),
            "length": [len(t) for t in self.tokens], "loss_tokens": [int(m.sum()) for m in self.masks]})

    def read(self, file: str, start: int, length: int) -> dict:
        """Tokens 0 .. start + length of a record: the window start .. start + length and its context."""
        i, end = int(file), start + length
        return {"input_ids": self.tokens[i][:end], "loss_mask": self.masks[i][:end], "context": start}

    def token_ids(self, file: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[int(file)], self.masks[int(file)]


class OnlineFeatures:
    """Turns a list of `RecordCache` items into the cached mode's batch, computing their features with `target`
    (moved to the batch's device the first time: each DDP rank has its own copy on its own device)."""

    def __init__(self, target, max_len: int, pack: bool, feature_layers: tuple[int, ...] = ()) -> None:
        self.target, self.max_len, self.pack = target, max_len, pack
        self.feature_layers = tuple(feature_layers)

    def __call__(self, items: list[dict], device) -> dict[str, torch.Tensor]:
        device = torch.device(device)
        if self.target.device != device:
            self.target.model.to(device)
        outs = target_features(self.target, [item["input_ids"].tolist() for item in items], self.feature_layers)
        windows = []
        for item, out in zip(items, outs):
            start = int(item["context"])
            hidden, taps = out if self.feature_layers else (out, None)
            window = {"input_ids": item["input_ids"][start:].to(device),
                      "loss_mask": item["loss_mask"][start:].to(device),
                      "hidden": hidden[start:].to(device, torch.bfloat16)}   # as the cache stores them
            if taps is not None:
                window["taps"] = taps[start:].to(device, torch.bfloat16)
            if "group" in item:
                window["group"] = item["group"]
            windows.append(window)
        return collate(windows, self.max_len, self.pack, device)
