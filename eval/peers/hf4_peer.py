"""transformers 4.x loads the exported target folder and decodes greedily: run inside build/peers/hf4.

  build/peers/hf4/bin/python eval/peers/hf4_peer.py --target DIR --prompts prompts.json --out result.json

Checks what 4.x reads of the folder (rope_theta, the tokenizer class, the tied embedding) by decoding the same
prompt ids as every other engine. Imports nothing from eagle_lite.
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    spec = json.loads(open(args.prompts).read())
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    startup = time.perf_counter() - start
    rows = []
    for ids in spec["prompts"]:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=int(spec["max_new_tokens"]),
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        rows.append({"token_ids": out[0, len(ids):].tolist(), "seconds": time.perf_counter() - t0})
    result = {"engine": f"transformers {transformers.__version__}", "startup_s": startup, "rows": rows, "spec": {},
              "read": {"rope_theta": getattr(model.config, "rope_theta", None),
                       "tokenizer": type(tokenizer).__name__,
                       "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
                       "embedding_norm": float(model.model.embed_tokens.weight.norm())}}
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
