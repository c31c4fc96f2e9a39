"""llama.cpp (llama-cpp-python) decodes a GGUF file greedily from given prompt ids: run inside build/peers/llama.

  build/peers/llama/bin/python eval/peers/llama_peer.py --gguf FILE --prompts prompts.json --out result.json \
      [--threads 2] [--runs 3]

prompts.json holds {"prompts": [[ids...], ...], "max_new_tokens": N}: every engine gets the same prompt ids. Each
prompt is decoded --runs times (greedy: temperature 0, no repetition penalty; exactly N new tokens, an end-of-sequence
token included, as eagle_lite's stop_at_eos=False does); the fastest run is kept. Prints each prompt's tokens/s and
text; writes the rows (token ids, seconds) as the other peers do. Imports nothing from eagle_lite.
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gguf", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=1, help="timed runs per prompt; the fastest is kept")
    args = p.parse_args()
    import llama_cpp

    spec = json.loads(open(args.prompts).read())
    max_new = int(spec["max_new_tokens"])
    longest = max(len(ids) for ids in spec["prompts"]) + max_new + 8
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=max(512, longest), n_batch=512, verbose=False)
    startup = time.perf_counter() - start
    rows = []
    for ids in spec["prompts"]:
        best = None
        for _ in range(max(1, args.runs)):
            tokens: list[int] = []
            t0 = time.perf_counter()
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                tokens.append(int(token))
                if len(tokens) == max_new:
                    break
            seconds = time.perf_counter() - t0
            if best is None or seconds < best["seconds"]:
                best = {"token_ids": tokens, "seconds": seconds}
        rows.append(best)
        text = llm.detokenize(best["token_ids"]).decode("utf-8", errors="replace")
        print(f"{len(best['token_ids']) / best['seconds']:.1f} tokens/s ({args.threads} threads): {text!r}")
        print(f"token ids: {best['token_ids']}")
    result = {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})", "startup_s": startup,
              "rows": rows, "spec": {}}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
