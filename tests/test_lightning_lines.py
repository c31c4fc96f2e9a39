"""Each of Lightning's log lines prints once in a training run (Hydra's root handler), not twice."""
from __future__ import annotations

import io
import logging


def test_a_lightning_line_prints_once_where_the_root_logger_prints():
    import lightning.pytorch  # noqa: F401  (adds Lightning's console handler, as a training run's import does)

    from trainers.loggers import one_copy_of_lightning_lines

    root, stream = logging.getLogger(), io.StringIO()
    ours = logging.StreamHandler(stream)
    lightning = logging.getLogger("lightning")
    extra = logging.StreamHandler(io.StringIO())   # stands for the console handler Lightning adds at import
    lightning.addHandler(extra)
    root.addHandler(ours)
    try:
        one_copy_of_lightning_lines()
        assert not [h for h in lightning.handlers if type(h) is logging.StreamHandler]
        logging.getLogger("lightning.fabric.utilities.seed").info("Seed set to 0")
        assert stream.getvalue().count("Seed set to 0") == 1
        assert extra.stream.getvalue() == ""
    finally:
        root.removeHandler(ours)
        lightning.removeHandler(extra)


def test_lightnings_cloud_adverts_are_not_printed():
    """Lightning's rank-zero logger carries a filter that drops its "💡 Tip: ..." adverts and passes every other line
    (checked on the logger's own filters: what other tests leave of the logging setup does not matter)."""
    import lightning.pytorch  # noqa: F401

    from trainers.loggers import one_copy_of_lightning_lines

    one_copy_of_lightning_lines()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")

    def record(text: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.INFO, __file__, 1, text, (), None)

    assert not logger.filter(record("💡 Tip: For seamless cloud logging and experiment tracking, try installing"))
    assert logger.filter(record("GPU available: False, used: False"))
