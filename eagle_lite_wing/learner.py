"""The learner of `--adapt`: fine-tunes a copy of the serving head on the answers it served (capture.py).

Status (measured, docs/adapt.md): at most +0.5% accepted per step on the weak kinds, at 77-115 ms of CPU per
answered token, about ten times what decoding the token costs. Off unless `--adapt` is given.

It minimises the training loss itself (trainers/objective.py `head_loss`, the objective the head was trained with, read
from its folder's train_config.yaml), on batches of captured answers mixed with a replay share of the head's own
training data (a distill folder of answers as token ids, whose features the target computes a few records at a
time, once each), so that it does not forget the kinds it knows while it learns the ones it serves. What moves
(`LearnConfig.moves`): the whole head ("all"), or its fc and decoder layer with the norm and lm_head frozen
("layer").

`lengths` scores a head on records it has not trained on: the chain length a greedy chain of `depth` head tokens
gets at each answer position (objective.py `chain_lengths`), which the guard (adapt.py) compares root for
root between two heads; `accepted` is their mean.
"""
from __future__ import annotations

import json
import lzma
import random
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from trainers.objective import ObjectiveConfig, chain_lengths, collate, head_loss

from .capture import Captured

MOVES = ("all", "layer")


@dataclass(frozen=True)
class LearnConfig:
    moves: str = "all"          # what the learner updates (MOVES)
    lr: float = 1e-4            # AdamW's learning rate (constant)
    batch_tokens: int = 1024    # tokens a step reads, captured and replayed together
    window: int = 512           # the longest record a batch holds (longer ones: a random window of it)
    replay: float = 0.25        # share of a batch's tokens from the head's training data (0: none)
    replay_pool: int = 48       # training records whose features are kept for replay
    pool_tokens: int = 65536    # captured tokens the learner keeps to train on (the newest)
    depth: int = 4              # chain depth the guard scores heads at
    prompts: bool = False       # train on a captured record's prompt positions too (the target's distribution there)

    def __post_init__(self) -> None:
        if self.moves not in MOVES:
            raise ValueError(f"adapt moves must be one of {', '.join(MOVES)}, got {self.moves!r}")
        if self.lr <= 0 or self.batch_tokens < 1 or self.window < 8 or not 0 <= self.replay < 1:
            raise ValueError(f"adapt settings out of range: lr {self.lr}, batch_tokens {self.batch_tokens}, "
                             f"window {self.window}, replay {self.replay}")


def objective_of(head, folder: str | Path | None) -> ObjectiveConfig:
    """The objective `head` was trained with (its folder's train_config.yaml, `draft.objective`), else EAGLE's
    defaults for its design (EAGLE-3: the token loss alone; two training-time-test steps, or its parallel depth)."""
    path = Path(folder) / "train_config.yaml" if folder is not None else None
    if path is not None and path.is_file():
        import yaml

        try:
            cfg = (yaml.safe_load(path.read_text()) or {}).get("draft", {}).get("objective")
        except (OSError, yaml.YAMLError):
            cfg = None
        if isinstance(cfg, dict):
            known = set(ObjectiveConfig.__dataclass_fields__)
            return ObjectiveConfig(**{k: v for k, v in cfg.items() if k in known})
    eagle3 = head.design == "eagle3"
    return ObjectiveConfig(w_reg=0.0 if eagle3 else 1.0, w_cls=1.0 if eagle3 else 0.1,
                           ttt_steps=max(2, head.parallel or 0))


class Replay:
    """Records of a distill folder (`shard-*.jsonl[.xz]`: `input_ids`, answer `spans`) as training items, their
    features computed by the target when first drawn (`taps`: the layers the head reads)."""

    def __init__(self, target, folder: str | Path, taps: tuple[int, ...], window: int, pool: int,
                 seed: int = 0) -> None:
        self.target, self.taps, self.window, self.size = target, tuple(taps), window, pool
        self.shards = sorted(Path(folder).glob("shard-*.jsonl*"))
        if not self.shards:
            raise ValueError(f"replay folder {folder} holds no distill shards (shard-*.jsonl)")
        self.rng = random.Random(seed)
        self.items: list[dict] = []

    def _record(self) -> dict:
        path = self.rng.choice(self.shards)
        opener = lzma.open if path.suffix == ".xz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        return self.rng.choice([r for r in records if "input_ids" in r] or [{}])   # skipped prompts hold no answer

    def grow(self, n: int = 1) -> None:
        """Compute the features of up to n more records (until the pool is full)."""
        for _ in range(min(n, self.size - len(self.items))):
            record = self._record()
            ids = record.get("input_ids", [])[:self.window]
            mask = torch.zeros(len(ids), dtype=torch.bool)
            for start, end in record.get("spans", []):
                mask[start:min(end, len(ids))] = True
            if len(ids) < 3 or not bool(mask.any()):
                continue
            with torch.inference_mode():
                cache = self.target.new_cache(len(ids))
                ((hidden, features),) = self.target.verify(
                    [(torch.tensor(ids, device=self.target.device), cache, None, None)], taps=self.taps)
            item = {"input_ids": torch.tensor(ids), "loss_mask": mask, "hidden": hidden.to(torch.bfloat16).cpu()}
            if self.taps:
                item["taps"] = features.to(torch.bfloat16).cpu()
            self.items.append(item)

    def sample(self, tokens: int) -> list[dict]:
        out, total = [], 0
        while self.items and total < tokens:
            item = self.rng.choice(self.items)
            out.append(item)
            total += len(item["input_ids"])
        return out


class Learner:
    """Trains `head` (a trainable fp32 copy, not the serving one) on captured answers (`add`) and replay."""

    def __init__(self, target, head, objective: ObjectiveConfig, cfg: LearnConfig = LearnConfig(),
                 replay: Replay | None = None, seed: int = 0) -> None:
        self.head, self.objective, self.cfg, self.replay = head.float().train(), objective, cfg, replay
        lm = target.lm_head.weight.detach().float()
        self.full_weight = lm
        self.embed_weight = target.embed_tokens.weight.detach().float()
        self.draft_weight = lm if head.d2t is None else lm[head.d2t.to(lm.device)]
        frozen = (head.norm, head.lm_head) if cfg.moves == "layer" else ()
        frozen_ids = {id(p) for m in frozen if m is not None for p in m.parameters()}
        self.params = [p for p in head.parameters() if id(p) not in frozen_ids]
        trained = {id(p) for p in self.params}
        for p in head.parameters():
            p.requires_grad_(id(p) in trained)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.pool: deque[Captured] = deque()
        self._pool_tokens = 0
        self.rng = random.Random(seed)
        self.steps = 0
        self.seconds = 0.0        # time spent training (replay features included)

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained head's state dict."""
        return self.head.state_dict()

    def restart(self, state: dict[str, torch.Tensor]) -> None:
        """Train again from the head `state` (the champion): its weights, no momentum."""
        self.head.load_state_dict(state)
        self.optimizer.state.clear()

    def add(self, records: list[Captured]) -> None:
        """Captured answers to train on from now on (the newest `pool_tokens` are kept)."""
        for record in records:
            self.pool.append(record)
            self._pool_tokens += len(record)
        while self._pool_tokens > self.cfg.pool_tokens and len(self.pool) > 1:
            self._pool_tokens -= len(self.pool.popleft())

    def _window(self, item: dict) -> dict:
        n = len(item["input_ids"])
        if n <= self.cfg.window:
            return item
        start = self.rng.randrange(n - self.cfg.window + 1)
        return {k: v[start:start + self.cfg.window] for k, v in item.items()}

    def _batch(self) -> dict | None:
        want = self.cfg.batch_tokens
        items, total = [], 0
        captured = list(self.pool)
        share = want * (1 - self.cfg.replay) if self.replay is not None else want
        while captured and total < share:
            item = self._window(self.rng.choice(captured).item())
            if self.cfg.prompts:   # every position's target distribution, the prompt's as well as the answer's
                item = {**item, "loss_mask": torch.ones_like(item["loss_mask"])}
            items.append(item)
            total += len(item["input_ids"])
        if not items:
            return None
        if self.replay is not None:
            self.replay.grow(1)
            items += [self._window(item) for item in self.replay.sample(want - total)]
        return collate(items, self.cfg.window, pack=True)

    def train(self, steps: int) -> float:
        """Run up to `steps` optimizer steps; returns the mean loss (nan where there is nothing to train on)."""
        t0, losses = time.perf_counter(), []
        for _ in range(steps):
            batch = self._batch()
            if batch is None:
                break
            loss = head_loss(self.head, batch, self.embed_weight, self.draft_weight, self.objective)["loss"]
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.optimizer.step()
            self.steps += 1
            losses.append(float(loss.detach()))
        self.seconds += time.perf_counter() - t0
        return sum(losses) / len(losses) if losses else float("nan")

    def lengths(self, head, records: list[Captured]) -> torch.Tensor:
        """[roots] the chain length a greedy chain of `depth` tokens of `head` (either design; fp32) gets at each
        answer position of `records`, in order: two heads scored on the same records are scored root for root (a
        record longer than the window is read at its end, the same rows for every head)."""
        if not records:
            return torch.zeros(0)
        was = head.training
        head.eval()
        out = []
        for i in range(0, len(records), 8):
            items = [{k: v[-self.cfg.window:] for k, v in r.item().items()} for r in records[i:i + 8]]
            out.append(chain_lengths(head, collate(items, self.cfg.window, pack=True), self.embed_weight,
                                     self.full_weight, self.draft_weight, self.cfg.depth))
        head.train(was)
        return torch.cat(out)

    def accepted(self, head, records: list[Captured]) -> float:
        """Tokens per step a greedy chain of `depth` tokens of `head` gets on `records` (`lengths`' mean)."""
        lengths = self.lengths(head, records)
        return float(lengths.mean()) if lengths.numel() else 0.0
