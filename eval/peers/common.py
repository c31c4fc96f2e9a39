"""What the peer scripts share (eval/peers/check.py, side_by_side.py): where the exports and runs go, the prompts every
engine gets, where llama.cpp's binaries are and the speed under which a llama.cpp build is named broken."""
from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path("build/peers")
EXPORTS = ROOT / "exports"
RUN = ROOT / "run"
QUESTIONS = Path("eval/questions/heldout12.jsonl")
LLAMA_BIN = ROOT / "llama" / "bin-dir"            # install.sh llama: the folder of the llama.cpp binaries it built
# llama.cpp's plain decoding speed with AVX2 (FACTS.md: ~57 tokens/s with 2 threads on these hosts, ~90 on the
# Xeon): a build under a tenth of it per thread is broken (AMX on a host where it stalls), not a slow CPU
AVX2_TOKENS_PER_S_PER_THREAD = 28.5


def llama_bin() -> Path | None:
    """The folder of llama.cpp's binaries: $LLAMA_CPP_BIN, else the one install.sh llama built; None if neither."""
    given = os.environ.get("LLAMA_CPP_BIN")
    if given:
        return Path(given)
    if LLAMA_BIN.is_file():
        return Path(LLAMA_BIN.read_text().strip())
    return None


def min_llama_speed(threads: int) -> float:
    """The plain tokens/s below which a llama.cpp build is named broken: a tenth of the AVX2 speed."""
    return 0.1 * AVX2_TOKENS_PER_S_PER_THREAD * min(max(threads, 1), 2)


def prompts(target, count: int) -> list[list[int]]:
    from eagle_lite.text.chat_format import chat_ids

    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()][:count]
    return [chat_ids(target.tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in questions]


def trimmed(tokens: list[int], eos: set[int]) -> list[int]:
    """Tokens up to the first end-of-sequence token (engines differ in whether they return it)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens
