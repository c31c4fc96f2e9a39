"""The core's shape: the engine knows drafters and observers, nothing else; nothing trains inside the runtime; the
unproven features live in eagle_lite_wing, each saying its measured status."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "eagle_lite"


def imported(path: Path) -> set[str]:
    """The modules `path` imports, relative imports resolved against its package (`from . import x` counts as
    the package's module x)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def test_the_engine_imports_no_drafter_head_controller_capture_or_store():
    names = imported(CORE / "decoding" / "engine.py")
    forbidden = [n for n in names if n.startswith(("eagle_lite.drafters", "eagle_lite.heads", "eagle_lite_wing"))
                 or n.split(".")[-1] in ("controller", "capture", "traffic", "cost")]
    assert not forbidden, forbidden
    assert "eagle_lite.decoding.observer" in names and "eagle_lite.decoding.drafter" in names


def test_the_import_check_sees_relative_imports():
    names = imported(CORE / "drafters" / "lookup_graft.py")
    assert "eagle_lite.decoding.drafter" in names and "eagle_lite.drafters.prompt_lookup" in names


@pytest.mark.parametrize("folder", ["heads", "decoding", "drafters"])
def test_nothing_in_the_runtime_trains(folder):
    for path in (CORE / folder).rglob("*.py"):
        text = path.read_text()
        assert "torch.optim" not in text and "from torch import optim" not in text, path
        assert not any(n.startswith("trainers") for n in imported(path)), path


def test_heads_hold_modules_and_checkpoints_only():
    assert not (CORE / "heads" / "objective.py").exists() and (ROOT / "trainers" / "objective.py").is_file()
    assert not any((CORE / "heads" / name).exists() for name in ("learner.py", "adapt.py"))


def test_the_wing_holds_the_unproven_each_with_its_measured_status():
    wing = ROOT / "eagle_lite_wing"
    for name in ("adapt.py", "learner.py", "capture.py", "traffic.py", "parallel.py", "auto.py", "controller.py"):
        doc = ast.get_docstring(ast.parse((wing / name).read_text()))
        assert re.search(r"\d\.\d+", doc) and ("Status" in doc or "status" in doc), name
    for name in ("traffic.py", "capture.py", "auto.py", "controller.py"):
        assert not list(CORE.rglob(name)), name
    assert "mask_rows" not in (CORE / "drafters" / "eagle.py").read_text()   # the parallel head drafts in the wing
    assert "lowrank" not in (wing / "learner.py").read_text()   # measured a loss everywhere: removed
    assert "low-rank" in (ROOT / "docs" / "adapt.md").read_text()   # with the record of what was measured
    assert not (CORE / "serve" / "cost.py").exists()   # the server's caps: decoding/cost.py `Caps`


def test_the_step_backend_names_no_method():
    """The fixed-shape step is chosen from what the drafter says of itself (`fixed_shape`), not from its name."""
    from eagle_lite.drafters.registry import names

    NAMES = names()
    tree = ast.parse((CORE / "pipeline.py").read_text())
    backend = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "step_backend")
    strings = {n.value for n in ast.walk(backend) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not strings & set(NAMES), strings & set(NAMES)


def test_the_core_never_imports_the_wing_and_trainers_never_import_eval():
    """The wing registers itself through the plugin entry point (drafters/plugins.py): nothing under eagle_lite/
    imports eagle_lite_wing; trainers run eval's commands instead of importing it."""
    for folder, banned in ((CORE, "eagle_lite_wing"), (CORE.parent / "trainers", "eval")):
        for path in folder.rglob("*.py"):
            tree = ast.parse(path.read_text())
            found = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Import)
                     and any(a.name.split(".")[0] == banned for a in n.names)
                     or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == banned and not n.level]
            assert not found, (path, found)


def test_the_engine_pipeline_and_server_call_drafter_methods_instead_of_probing_attributes():
    """An explicit drafter base (decoding/drafter.py) has a default for every optional hook: no getattr/hasattr on a
    drafter in decoding/, pipeline.py or serve/."""
    files = [*(CORE / "decoding").rglob("*.py"), CORE / "pipeline.py", *(CORE / "serve").rglob("*.py")]
    for path in files:
        tree = ast.parse(path.read_text())
        probes = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "hasattr") and n.args and "drafter" in ast.unparse(n.args[0])]
        assert not probes, (path, probes)


def test_the_registry_is_a_table():
    """Each method's options live beside its drafter; the registry holds the table and its lookups."""
    assert len((CORE / "drafters" / "registry.py").read_text().splitlines()) <= 150
