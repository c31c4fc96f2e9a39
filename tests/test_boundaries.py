"""House rules a reader of one file cannot see. The kernels package is reached through its entry points only:
`eagle_lite.kernels` (what accelerate.py names) for the speed-ups and `kernels.attention` for the attention
backends, so a kernel module can be split or renamed without touching the drafters, heads and targets that use it.
The runtime's comments and docstrings quote no timings: they go stale with every host and kernel; docs/ holds them.
An engine is assembled in one place (the pipeline's factories), and eval/'s entry points share library modules
instead of importing one another."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import eagle_lite.kernels as kernels
from eagle_lite.kernels import accelerate, cpu_linear, fused_layer, grid_linear

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"eagle_lite.kernels", "eagle_lite.kernels.accelerate", "eagle_lite.kernels.attention"}


def imported_modules(file: Path) -> set[str]:
    """Every module `file` imports from, at any depth of the file (relative imports resolved; `from package import
    module` counts as the module)."""
    package = file.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            folder = ROOT.joinpath(*module.split("."))
            out |= {f"{module}.{a.name}" if (folder / f"{a.name}.py").is_file() else module for a in node.names}
    return out


def test_kernel_internals_are_imported_through_the_entry_points_only():
    outside = [f for folder in ("eagle_lite", "trainers", "eval") for f in (ROOT / folder).rglob("*.py")
               if "kernels" not in f.relative_to(ROOT).parts]
    leaks = sorted((str(f.relative_to(ROOT)), m) for f in outside for m in imported_modules(f)
                   if m.startswith("eagle_lite.kernels") and m not in ENTRY_POINTS)
    assert leaks == []


def entry_point(file: Path) -> bool:
    """`file` runs as `python -m ...` (it has an `if __name__ == "__main__":` block)."""
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
               for node in ast.parse(file.read_text()).body)


def test_no_entry_point_in_eval_is_imported_by_another_module():
    entries = {".".join(f.relative_to(ROOT).with_suffix("").parts) for f in (ROOT / "eval").glob("*.py")
               if entry_point(f)}
    importers = [f for folder in ("eagle_lite", "trainers", "eval") for f in (ROOT / folder).rglob("*.py")]
    found = sorted((str(f.relative_to(ROOT)), m) for f in importers for m in imported_modules(f) & entries)
    assert entries and found == []


def test_engines_are_assembled_by_the_pipeline_only():
    made = sorted(str(f.relative_to(ROOT)) for folder in ("eagle_lite", "trainers", "eval")
                  for f in (ROOT / folder).rglob("*.py")
                  if any(isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] in
                         ("Engine", "StaticStep") for node in ast.walk(ast.parse(f.read_text()))))
    assert made == ["eagle_lite/pipeline.py"]


def test_the_package_top_level_and_the_readme_stay_small():
    assert len(list((ROOT / "eagle_lite").glob("*.py"))) <= 12
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220


def test_the_entry_point_names_the_kernels_own_objects():
    assert kernels.few_rows_product is accelerate.few_rows_product is cpu_linear.few_rows_product
    assert kernels.running_fused is fused_layer.running_fused
    assert (kernels.FEW_ROWS, kernels.MAX_GRID_ROWS, kernels.MAX_FUSED_ROWS) == (
        cpu_linear.FEW_ROWS, grid_linear.MAX_GRID_ROWS, fused_layer.MAX_FUSED_ROWS)
    assert set(kernels.__all__) <= set(accelerate.__all__)


TIMING = re.compile(r"\d\s?(ms|us|µs)\b|tokens?/s\b|\d(\.\d+)?x (faster|slower)|~\d[\d.]*\s?(s|sec|min)\b")


def prose(file: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of `file`."""
    source = file.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                first = node.body[0].lineno
                out += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def test_runtime_comments_and_docstrings_quote_no_timings():
    found = [f"{f.relative_to(ROOT)}:{line}: {text.strip()}" for f in sorted((ROOT / "eagle_lite").rglob("*.py"))
             for line, text in prose(f) if TIMING.search(text)]
    assert found == []
    assert TIMING.search("took ~2.9 ms") and TIMING.search("~30 tokens/s") and TIMING.search("2x faster")
