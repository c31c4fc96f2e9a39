"""`--format gguf-eagle3` against llama.cpp's own converter: the same tensors and metadata, or what differs.

  python -m eval.peers.gguf_compare --llama-cpp DIR [--head eagle_lite/heads/smollm2] [--out build/peers/gguf]

DIR: a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py; e.g. the one the llama-cpp-python sdist vendors, which
install.sh llama unpacks to build/peers/llama/llama.cpp). Writes the head with `--format gguf-eagle3`, and with
`--format eagle3` plus the target as a Hugging Face folder, which llama.cpp's converter turns into its GGUF
(`convert_hf_to_gguf.py HEAD --target-model-dir TARGET --outtype bf16`); then compares every key and tensor (type,
shape, bytes). The converter needs the `sentencepiece` module in the interpreter that runs it (--python).
Exit status 0 when every tensor is identical, 1 otherwise.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

# keys one writer sets and the other does not, by design: the converter's size label and the file's name; the
# export's provenance record and the target file's add_space_prefix (the tokenizer is copied from the target GGUF)
EXPECTED = {"general.size_label", "general.name", "eagle_lite.record", "tokenizer.ggml.add_space_prefix"}


def compare(ours: Path, theirs: Path) -> tuple[list[str], bool]:
    """Lines saying what differs between two GGUF files, and whether every tensor is identical."""
    import numpy as np
    from gguf import GGUFReader

    a, b = GGUFReader(str(ours)), GGUFReader(str(theirs))
    fa = {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.")}
    fb = {k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.")}
    lines = []
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):
            mark = "expected" if key in EXPECTED else "DIFFERS"
            lines.append(f"key {key}: export {str(fa.get(key, '<absent>'))[:60]!r}, converter "
                         f"{str(fb.get(key, '<absent>'))[:60]!r} ({mark})")
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    same = set(ta) == set(tb)
    for name in sorted(set(ta) ^ set(tb)):
        lines.append(f"tensor {name}: only in the {'export' if name in ta else 'converter'}'s file")
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        equal = (x.tensor_type == y.tensor_type and [int(n) for n in x.shape] == [int(n) for n in y.shape]
                 and np.array_equal(np.asarray(x.data), np.asarray(y.data)))
        same &= equal
        lines.append(f"tensor {name}: {x.tensor_type.name} {[int(n) for n in x.shape]} "
                     f"{'identical' if equal else 'DIFFERS'}")
    return lines, same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.peers.gguf_compare", description=__doc__.split("\n")[0])
    p.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree with convert_hf_to_gguf.py")
    p.add_argument("--head", default="eagle_lite/heads/smollm2")
    p.add_argument("--out", default="build/peers/gguf")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs llama.cpp's converter")
    args = p.parse_args(argv)
    converter = Path(args.llama_cpp) / "convert_hf_to_gguf.py"
    if not converter.is_file():
        print(f"error: no convert_hf_to_gguf.py in {args.llama_cpp}: give a llama.cpp source tree", file=sys.stderr)
        return 2
    import torch

    from eagle_lite.export import export, export_target
    from eagle_lite.formats.gguf_eagle3 import file_name
    from eagle_lite.targets.loading import load_target

    out = Path(args.out)
    target = load_target("smollm2")
    export(args.head, "gguf-eagle3", out / "export", target, torch.bfloat16)
    export(args.head, "eagle3", out / "eagle3", target, torch.bfloat16)
    if not (out / "target" / "config.json").is_file():
        export_target("smollm2", out / "target")
    theirs = out / "converter" / file_name(target.name)
    theirs.parent.mkdir(parents=True, exist_ok=True)
    cmd = [args.python, str(converter), str(out / "eagle3"), "--target-model-dir", str(out / "target"),
           "--outtype", "bf16", "--outfile", str(theirs)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"error: llama.cpp's converter failed: `{' '.join(cmd)}`: {tail}", file=sys.stderr)
        return 2
    lines, same = compare(out / "export" / file_name(target.name), theirs)
    print("\n".join(lines))
    print(f"{'every tensor identical' if same else 'tensors differ'}: export {out / 'export'} against llama.cpp's "
          f"converter {theirs}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
