"""Which process of a multi-process training this one is, before Lightning's Trainer exists.

The data stages (distill, features) run before the fit. How many processes share them depends on who started them:

- `torchrun` / torch elastic, or SLURM's `srun` (Lightning's own cluster environments detect both): every rank is
  running from the start. The stages are shared over the ranks (`Ranks.rank` of `Ranks.world`), meeting at barriers of
  a process group set up here, which Lightning's DDP/FSDP strategy then takes over as it is.
- `python -m trainers.train trainer=ddp` on one machine: Lightning starts the other ranks itself, inside `Trainer.fit`,
  so rank 0 runs the data stages alone first; the ranks it starts find them done (`Ranks.spawned`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch

log = logging.getLogger("trainers.ranks")
_DATA_GROUP = None   # the gloo group the data stages meet in (CPU objects, whatever the fit's backend)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0          # global rank
    world: int = 1         # processes sharing the data stages now
    spawned: bool = False  # started by Lightning inside Trainer.fit: rank 0 prepared the data before
    local: int = 0         # rank within its machine: its GPU

    def device(self, device: str) -> str:
        """This rank's own GPU where `device` says only "cuda" (every rank would build its target on GPU 0)."""
        return f"cuda:{self.local}" if device == "cuda" and self.world > 1 else device

    @property
    def zero(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Every rank waits here for the others (no-op on one process)."""
        if self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier(group=_DATA_GROUP)

    def broadcast(self, value):
        """Rank 0's `value` on every rank (a picklable object of our own making)."""
        if self.world == 1 or not torch.distributed.is_initialized():
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0, group=_DATA_GROUP)
        return box[0]


def external_environment():
    """Lightning's cluster environment for ranks started outside Lightning (torchrun, SLURM), or None."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect() and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return SLURMEnvironment()
    return None


def current(num_nodes: int = 1) -> Ranks:
    """This process's place, from the environment (see the module doc); num_nodes: `trainer.num_nodes`."""
    env = external_environment()
    if env is not None:
        return Ranks(env.global_rank(), env.world_size(), local=env.local_rank())
    local = os.environ.get("LOCAL_RANK")
    if local is not None and "WORLD_SIZE" in os.environ:   # a rank Lightning's subprocess launcher started
        world = int(os.environ["WORLD_SIZE"])
        per_node = max(world // max(num_nodes, 1), 1)
        return Ranks(int(os.environ.get("NODE_RANK", "0")) * per_node + int(local), world, spawned=True,
                     local=int(local))
    return Ranks()


def join(ranks: Ranks, accelerator: str = "cpu") -> None:
    """Set up the default process group for ranks started outside Lightning, so the data stages can meet at barriers;
    Lightning's strategy finds it set up and uses it. CPU collectives run on gloo, CUDA ones on NCCL."""
    if ranks.world == 1 or ranks.spawned or torch.distributed.is_initialized():
        return
    env = external_environment()
    os.environ.setdefault("MASTER_ADDR", env.main_address)
    os.environ.setdefault("MASTER_PORT", str(env.main_port))
    backend = "cpu:gloo,cuda:nccl" if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, rank=ranks.rank, world_size=ranks.world,
                                         timeout=timedelta(hours=2))   # a rank's share of a stage may take long
    global _DATA_GROUP
    _DATA_GROUP = None if backend == "gloo" else torch.distributed.new_group(backend="gloo")
    log.info("rank %d of %d joined the process group (%s)", ranks.rank, ranks.world, backend)
