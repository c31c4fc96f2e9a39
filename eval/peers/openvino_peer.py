"""OpenVINO GenAI on given prompt ids, greedy, batch 1, exact fp32: run inside build/peers/openvino.

  build/peers/openvino/bin/python eval/peers/openvino_peer.py --target OV_DIR [--draft OV_DIR --k 3] \
      --prompts prompts.json --out result.json

OV_DIR: a folder `optimum-cli export openvino --weight-format fp32` wrote (the draft: of an EAGLE-3 head in
LlamaForCausalLMEagle3 layout). Precision: INFERENCE_PRECISION_HINT f32 and an f32 KV cache (the CPU default
computes in bf16, which changes the tokens). result.json as vllm_peer.py's, with the speculative counters
OpenVINO GenAI reports (accepted draft tokens, main-model inferences) where it reports them.
Imports nothing from eagle_lite.
"""
from __future__ import annotations

import argparse
import json
import time

EXACT = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def sd_counters(result) -> dict[str, float]:
    """What the speculative-decoding metrics of one generate() say (names differ across GenAI releases)."""
    ext = getattr(result, "extended_perf_metrics", None)
    out: dict[str, float] = {}
    if ext is None:
        return out
    for name in ("get_num_accepted_tokens", "get_acceptance_rate", "get_num_generated_tokens"):
        fn = getattr(ext, name, None)
        if callable(fn):
            try:
                value = fn()
                out[name.removeprefix("get_")] = float(value if not isinstance(value, list) else sum(value))
            except Exception:     # a metric the pipeline does not fill
                pass
    main = getattr(ext, "main_model_metrics", None)
    raw = getattr(main, "raw_metrics", None) if main is not None else None
    if raw is not None:
        out["main_inferences"] = float(len(raw.m_durations))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--k", type=int, default=3, help="num_assistant_tokens")
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1, help="INFERENCE_NUM_THREADS")
    args = p.parse_args()
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    spec = json.loads(open(args.prompts).read())
    prompts, max_new = spec["prompts"], int(spec["max_new_tokens"])
    start = time.perf_counter()
    EXACT["INFERENCE_NUM_THREADS"] = args.threads
    extra = {}
    if args.draft:
        extra["draft_model"] = genai.draft_model(args.draft, "CPU", **EXACT)
    pipe = genai.LLMPipeline(args.target, "CPU", **EXACT, **extra)
    startup = time.perf_counter() - start
    config = genai.GenerationConfig(max_new_tokens=max_new, do_sample=False)
    if args.draft:
        config.num_assistant_tokens = args.k

    def run(ids, cfg):
        inputs = genai.TokenizedInputs(ov.Tensor(np.array([ids], dtype=np.int64)),
                                       ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))
        return pipe.generate(inputs, cfg)

    warm = genai.GenerationConfig(max_new_tokens=8, do_sample=False)
    if args.draft:
        warm.num_assistant_tokens = args.k
    run(prompts[0], warm)                                               # warm-up, untimed
    rows, totals = [], {}
    for ids in prompts:
        t0 = time.perf_counter()
        result = run(ids, config)
        seconds = time.perf_counter() - t0
        rows.append({"token_ids": [int(t) for t in result.tokens[0]], "seconds": seconds})
        for k, v in sd_counters(result).items():
            totals[k] = totals.get(k, 0.0) + v
    result = {"engine": f"OpenVINO GenAI {genai.get_version()} CPU", "startup_s": startup, "rows": rows,
              "spec": totals, "draft": args.draft, "k": args.k if args.draft else None}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
