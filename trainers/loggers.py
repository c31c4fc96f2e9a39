"""The fit's logger, chosen with `logger=csv|tensorboard|wandb|mlflow` (conf/logger/): Lightning's own loggers,
checked before any stage runs so that a logger that cannot work is refused in one line instead of after the data."""
from __future__ import annotations

import importlib.util
import logging
import socket

import hydra
from omegaconf import DictConfig

# what each of Lightning's loggers imports, and the extra of eagle_lite's that installs it
NEEDS = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
    "WandbLogger": (("wandb",), "wandb"),
    "MLFlowLogger": (("mlflow",), "mlflow"),
}
WANDB_HOST = ("api.wandb.ai", 443)


def check_logger(cfg: DictConfig) -> None:
    """Refuse a logger that cannot be built here (its package not installed), or one given the way that is ignored
    (trainer.logger): ValueError naming the fix."""
    if cfg.trainer.get("logger") is not None:
        raise ValueError("trainer.logger is not read: choose the fit's logger with logger=csv|tensorboard|wandb|"
                         "mlflow (conf/logger/), and its settings as logger.KEY=VALUE")
    node = cfg.get("logger")
    if node is None:
        return
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ValueError(f"logger must be one of conf/logger/ (csv, tensorboard, wandb, mlflow), got {node!r}")
    kind = str(node._target_).rsplit(".", 1)[-1]
    modules, extra = NEEDS.get(kind, ((), None))
    if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
        raise ValueError(f"logger={extra} needs the package {modules[0]}, which is not installed: "
                         f"pip install -e '.[{extra}]' (or choose logger=csv)")


def reachable(host: tuple[str, int], timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection(host, timeout=timeout):
            return True
    except OSError:
        return False


def build_logger(cfg: DictConfig):
    """The fit's Lightning logger from cfg.logger (None: none)."""
    node = cfg.get("logger")
    if node is None:
        return None
    settings = {}
    if str(node._target_).endswith("WandbLogger") and node.get("offline") is None:
        settings["offline"] = not reachable(WANDB_HOST)   # no network: log offline, sync later
    return hydra.utils.instantiate(node, **settings)


def one_copy_of_lightning_lines() -> None:
    """Lightning's package logger ("lightning") prints on a console handler of its own and passes each line on to
    the root logger too, which Hydra prints as well: where the root has a handler, Lightning's own goes, so each
    line prints once (in Hydra's format, and into the run's log file). Its adverts print nowhere (`NoAdverts`)."""
    adverts = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, NoAdverts) for f in adverts.filters):
        adverts.addFilter(NoAdverts())
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True


class NoAdverts(logging.Filter):
    """Drops Lightning's tips to install its cloud services ("💡 Tip: For seamless cloud logging ..."), which it
    prints at every training start: an advert, not a line about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")
