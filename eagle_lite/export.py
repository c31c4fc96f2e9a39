"""`python -m eagle_lite.export HEAD --format eagle|eagle3|gguf-eagle3|medusa --out DIR`: a head in the layout others
serve;
`python -m eagle_lite.export --target smollm2 --out DIR`: the target as a standard Hugging Face folder.

  python -m eagle_lite.export eagle_lite/heads/smollm2 --format eagle --out smollm2-eagle
  python -m eagle_lite.export runs/train/.../head --format eagle3 --out my-eagle3     # experiment=eagle3's head
  python -m eagle_lite.export runs/train/.../medusa/head --format medusa --out my-medusa
  python -m eagle_lite.export eagle_lite/heads/smollm2 --format gguf-eagle3 --out smollm2-gguf   # llama.cpp

eagle:  official EAGLE (EaModel, use_eagle3=False), vLLM (speculative_config method "eagle"), SGLang
        (--speculative-algorithm EAGLE); a reduced draft vocabulary goes with it as SGLang's hot-token map.
eagle3: official EAGLE-3, vLLM (method "eagle3"), SGLang (EAGLE3), SpecForge's layout.
gguf-eagle3: llama.cpp's EAGLE-3 draft (llama-server -md FILE --spec-type draft-eagle3), one GGUF file with the
        tensors and metadata llama.cpp's converter writes (formats/gguf_eagle3.py); the tokenizer comes from the
        target's GGUF file (--target-gguf, default the one the target was loaded from). EAGLE-1/2 heads: refused,
        llama.cpp has no EAGLE-1 draft.
medusa: vLLM (method "medusa") and FasterDecoding/Medusa.
No HEAD: the target itself (formats/hf_target.py), the folder vLLM, official EAGLE, OpenVINO's converter and
        transformers 4.x and 5.x load as they are; reloaded once with transformers and checked against the original.
What a loader will do differently with the head is printed as notes, with what it costs, measured; a folder an
engine would draft worse from (more than AGREEMENT_MARGIN) or a head the format cannot express is refused with the
reason. docs/deploy.md has the serving commands.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from .atomic import write_json_atomic
from .cli import UsageError, entry_point
from .config import default_tree

FORMATS = ("eagle", "eagle3", "gguf-eagle3", "medusa")
ENGINES = ("official", "sglang", "vllm")
EAGLE3_ENGINES = ("openvino", "speculators")          # --format eagle3 only
DTYPES = ("bfloat16", "float16", "float32")
# How far an engine's measured first-token agreement (formats/fidelity.py) may fall below the head's own, as a share
# of the measured positions, before a folder it would run inexactly is refused without --allow-lossy. Within it the
# engine drafts as well as the head as far as the measurement tells; docs/deploy.md states it.
AGREEMENT_MARGIN = 0.02


def head_config(path: Path) -> dict:
    """The head folder's config.json ({} without one); one that is not a JSON object is refused, naming the file."""
    from .formats.detect import read_json

    file = Path(path) / "config.json"
    return read_json(file) if file.is_file() else {}


def head_record(path: Path) -> dict:
    """The eagle_lite record an export carries (config.json "eagle_lite"): the target's fingerprint, the training
    summary and the recommended trees of an eagle_lite head; a published folder's own record, if it has one."""
    config = head_config(path)
    if "format" not in config:
        return dict(config.get("eagle_lite") or {})
    keys = ("target", "target_spec", "training", "tree", "tree_measured", "tree_cuda", "tree_cuda_measured")
    return {k: config[k] for k in keys if k in config}


def target_spec(path: Path, given: str | None) -> str:
    """--target, else the target the head records (`options.target_of`)."""
    from .heads.checkpoint import recorded_target
    from .options import target_of

    spec = target_of(given, path) or recorded_target(path)   # one not on this machine: its load says why
    if not spec:
        raise ValueError(f"{path} does not say which target it was made for: pass --target SPEC")
    return spec


class LossyExport(ValueError):
    """An engine would run the head inexactly, drafting worse by more than AGREEMENT_MARGIN, and --allow-lossy was
    not given."""


def export(head_path: str | Path, fmt: str, out: str | Path, target, dtype: torch.dtype, engine: str = "all",
           allow_lossy: bool = False, verifier: str | None = None, target_gguf: str | Path | None = None) -> list[str]:
    """Write the head at `head_path` (any folder --draft / --medusa take) for `target` in format `fmt` to `out`;
    returns the notes for the user. engine (format eagle): the engine the folder is for, "all" for every one.
    What an engine runs differently of the head is measured and noted; where its first-token agreement drops by
    more than AGREEMENT_MARGIN the head is refused (LossyExport) with the measurement unless allow_lossy.
    target_gguf (format gguf-eagle3): the target's GGUF file, whose tokenizer the draft file carries."""
    from .formats import load_head, load_medusa
    from .formats.eagle import write_eagle
    from .formats.eagle3 import write_eagle3
    from .formats.medusa import write_medusa

    head_path, out = Path(head_path), Path(out)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if out.resolve() == head_path.resolve():
        raise ValueError(f"--out {out} is the head's own folder: give another folder")
    meta = {"target": target.fingerprint(), **head_record(head_path), "exported_from": str(head_path)}
    if fmt == "medusa":
        return write_medusa(load_medusa(head_path, target), target, out, meta, dtype)
    if fmt == "eagle" and engine in EAGLE3_ENGINES:
        raise ValueError(f"--engine {engine} is a layout of EAGLE-3 drafts only: export an EAGLE-3 head with "
                         f"--format eagle3")
    if fmt == "gguf-eagle3" and engine != "all":
        raise ValueError(f"--engine {engine} is a layout of --format eagle/eagle3: gguf-eagle3 is for llama.cpp")
    head = load_head(head_path, target)
    if fmt == "gguf-eagle3":
        from .formats.gguf_eagle3 import write_gguf_eagle3

        return write_gguf_eagle3(head, target, out, meta, dtype, target_gguf)
    if fmt == "eagle3":
        return write_eagle3(head, target, out, meta, dtype, engine, verifier)
    losses = eagle_losses(head, target, engine)
    lossy = [loss for loss in losses if loss.drop > AGREEMENT_MARGIN]
    if lossy and not allow_lossy:
        exact = [n for n in ENGINES if n not in {loss.engine for loss in losses} and engine in ("all", n)]
        hint = (f"--engine {exact[0]} writes it exactly for {exact[0]}; " if exact else "")
        raise LossyExport(f"{' '.join(f'{loss.sentence()}: {below(loss)}.' for loss in lossy)} Not written: "
                          f"{hint}--allow-lossy writes it anyway")
    notes = write_eagle(head, target, out, meta, dtype, engine="vllm" if engine == "vllm" else "all")
    return notes + [f"lossy, written with --allow-lossy: {loss.sentence()}: {below(loss)}" if loss in lossy else
                    f"differs, written (within the margin): {loss.sentence()}" for loss in losses]


def below(loss) -> str:
    """How far `loss`'s agreement falls short, against the margin."""
    return (f"{100 * loss.drop:.1f} points below, more than the {100 * AGREEMENT_MARGIN:g} the export allows without "
            f"--allow-lossy")


def eagle_losses(head, target, engine: str) -> list:
    """What each engine the eagle folder is for runs differently of `head`, measured (formats/fidelity.Loss)."""
    from .formats.fidelity import measured_losses

    if head.design == "eagle3" or head.fuse is not None:
        return []                                   # write_eagle refuses these with its own reason
    return measured_losses(head, target, ENGINES if engine == "all" else (engine,), vllm_layout=engine == "vllm")


def vllm_tree(depth: int, top_k: int, total_tokens: int) -> list[tuple[int, ...]]:
    """A static tree vLLM's speculative_token_tree can run: b children of the root (its b likeliest tokens), each
    followed by a chain of its top-1 continuations to `depth` (vLLM's tree proposer needs every node of a level to
    have the same number of children); b * depth <= total_tokens nodes."""
    branches = max(1, min(top_k, total_tokens // depth))
    return [(b,) + (0,) * level for level in range(depth) for b in range(branches)]


def serving_flags(tree: dict) -> dict[str, str]:
    """The settings of each server closest to eagle_lite's tree {depth, top_k, total_tokens} (config.json "tree"):
    SGLang and official EAGLE run the same dynamic EAGLE-2 tree; vLLM runs a static one (`vllm_tree`)."""
    depth, top_k, total = int(tree["depth"]), int(tree["top_k"]), int(tree["total_tokens"])
    return {
        "sglang": f"--speculative-num-steps {depth} --speculative-eagle-topk {top_k} "
                  f"--speculative-num-draft-tokens {total + 1}",
        "official": f"EaModel.from_pretrained(..., depth={depth - 1}, top_k={top_k}, total_token={total + 1})",
        # num_speculative_tokens counts the tree's nodes (vLLM's docs: a 5-node tree with 5)
        "vllm": f'"num_speculative_tokens": {len(vllm_tree(depth, top_k, total))}, '
                f'"speculative_token_tree": "{vllm_tree(depth, top_k, total)}"',
    }


def build_parser() -> argparse.ArgumentParser:
    from .options import add_flag

    p = argparse.ArgumentParser(prog="python -m eagle_lite.export",
                                description="Write a draft head in the layout official EAGLE, SpecForge, vLLM and "
                                            "SGLang load (see docs/deploy.md for the serving commands).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("head", nargs="?", default=None,
                   help="the head folder: eagle_lite's own, or any published layout --draft/--medusa read; "
                        "leave out to export the target (--target) as a Hugging Face folder")
    p.add_argument("--format", default=None, choices=FORMATS, help="the layout to write (required with a head)")
    p.add_argument("--out", required=True, help="the folder to write (created; its head files are replaced)")
    add_flag(p, "target", note="here the default is the target the head records")
    p.add_argument("--engine", default="all", choices=("all", *ENGINES, *EAGLE3_ENGINES),
                   help="the engine the folder is for. eagle: vllm writes the layout that carries an fc bias "
                        "exactly in vLLM; all: one folder for every engine, refused if any would draft worse "
                        "(--allow-lossy). "
                        "eagle3: openvino adds the embedding optimum-cli export openvino needs; speculators writes "
                        "the speculators package's layout (vLLM reads it for EAGLE-3)")
    p.add_argument("--target-gguf", default=None,
                   help="--format gguf-eagle3: the target's GGUF file llama.cpp runs (its tokenizer goes into the "
                        "draft; default: the file the target was loaded from)")
    p.add_argument("--verifier", default=None,
                   help="--engine speculators: the target's name or path the config records (default: --target)")
    p.add_argument("--allow-lossy", action="store_true",
                   help="write a folder an engine would draft worse from: its measured first-token agreement more "
                        f"than {100 * AGREEMENT_MARGIN:g} points below the head's own (what differs is printed "
                        "either way)")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="dtype of the written weights (default: the head's stored dtype, else bfloat16; a target: "
                        "float32, the weights eagle_lite runs)")
    return p


def export_target(spec: str, out: str | Path, dtype: torch.dtype = torch.float32) -> list[str]:
    """Write target `spec` as a standard Hugging Face folder (formats/hf_target.py), reload it with transformers
    and check its logits equal the original's on a few tokens; returns the files written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .formats.hf_target import write_target
    from .targets.loading import model_folder

    folder = model_folder(spec)
    if Path(out).resolve() == Path(folder).resolve():
        raise ValueError(f"--out {out} is the target's own folder: give another folder")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    files = write_target(model, tokenizer, out, dtype)
    check_target_folder(model, out, dtype)
    return files


def check_target_folder(model: torch.nn.Module, out: str | Path, dtype: torch.dtype) -> None:
    """Reload `out` with transformers: its logits on a few tokens must equal `model`'s exactly."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    ids = torch.arange(1, 17).unsqueeze(0) % model.config.vocab_size
    with torch.no_grad():
        if not torch.equal(model(ids).logits, reloaded(ids).logits):
            raise RuntimeError(f"the folder written to {out} does not reload to the same model (logits differ)")


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import transformers

    from .targets.loading import load_target

    transformers.logging.disable_progress_bar()      # stdout holds the export's report only

    if args.head is None:
        return main_target(args)
    if args.format is None:
        raise UsageError("--format is required with a head folder (eagle, eagle3, gguf-eagle3 or medusa)")
    if args.target_gguf is not None and args.format != "gguf-eagle3":
        raise UsageError("--target-gguf is an option of --format gguf-eagle3")
    head = Path(args.head)
    if not head.is_dir():
        raise FileNotFoundError(f"no head folder at {head}")
    stored = head_config(head).get("dtype")
    dtype = getattr(torch, args.dtype or (stored if stored in DTYPES else "bfloat16"))
    target = load_target(target_spec(head, args.target))
    notes = export(head, args.format, args.out, target, dtype, args.engine, args.allow_lossy,
                   args.verifier or args.target, args.target_gguf)
    out = Path(args.out)
    if args.format == "gguf-eagle3":
        return report_gguf(out, target, notes, args.target_gguf)
    tree = head_record(head).get("tree_cuda")
    if args.format != "medusa":
        write_vllm_config(out, args.format, tree)
    print(f"wrote {args.format} head to {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    for note in notes:
        print(f"note: {note}")
    if args.format != "medusa":
        for line in serving_lines(tree, out / VLLM_CONFIG):
            print(line)
    return 0


def report_gguf(out: Path, target, notes: list[str], target_gguf: str | None) -> int:
    """What `main` prints for --format gguf-eagle3: the file, the notes, the llama-server command."""
    from .formats.gguf_eagle3 import file_name, serving_line
    from .targets.loading import gguf_file

    draft = out / file_name(target.name)
    print(f"wrote gguf-eagle3 head to {draft}")
    for note in notes:
        print(f"note: {note}")
    print(f"llama.cpp: {serving_line(target_gguf or gguf_file(target.spec), draft)}")
    return 0


VLLM_CONFIG = "vllm_speculative_config.json"   # vLLM's --speculative-config for an exported head, beside its files


def write_vllm_config(out: Path, fmt: str, tree: dict | None) -> Path:
    """vLLM's speculative config for the exported head at the GPU tree `serving_lines` names (its static tree is a
    list of up to ~60 tuples: a file to pass, not a line to copy)."""
    tree = tree if tree is not None else dataclasses.asdict(default_tree("cuda"))
    nodes = vllm_tree(int(tree["depth"]), int(tree["top_k"]), int(tree["total_tokens"]))
    config = {"method": fmt, "model": str(out.resolve()), "num_speculative_tokens": len(nodes),
              "speculative_token_tree": str(nodes)}
    return write_json_atomic(out / VLLM_CONFIG, config)


def serving_lines(tree: dict | None, vllm_config: Path | None = None) -> list[str]:
    """Each server's settings for the head's GPU tree (config.json "tree_cuda"), else for the GPU default
    (`config.default_tree`): servers run on GPUs, where a CPU's tree is far too small. vllm_config: the file
    `write_vllm_config` wrote, which vLLM's line then passes whole."""
    whose = "the head's recommended GPU tree"
    if tree is None:
        tree, whose = dataclasses.asdict(default_tree("cuda")), "no GPU tree recorded: the GPU default"
    flags = serving_flags(tree)
    if vllm_config is not None:
        flags["vllm"] = f"--speculative-config \"$(cat {vllm_config})\""
    return [f"{server}: {flag}   ({whose}: depth {tree['depth']}, top_k {tree['top_k']}, {tree['total_tokens']} "
            f"nodes)" for server, flag in flags.items()]


def main_target(args) -> int:
    """`--target SPEC --out DIR` with no head: the target as a Hugging Face folder."""
    if args.format is not None:
        raise UsageError(f"--format {args.format} needs a head folder; leave both out to export the target")
    if args.target is None:
        raise UsageError("give a head folder, or --target SPEC to export the target itself")
    files = export_target(args.target, args.out, getattr(torch, args.dtype or "float32"))
    print(f"wrote target {args.target} to {args.out}: {', '.join(files)} (reloaded with transformers: same logits)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
