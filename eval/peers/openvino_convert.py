"""Convert an exported folder to OpenVINO IR (fp32) inside build/peers/openvino.

  build/peers/openvino/bin/python eval/peers/openvino_convert.py SRC OUT

A target folder goes through `optimum-cli export openvino --weight-format fp32` as it is. An EAGLE-3 draft
(config architectures LlamaForCausalLMEagle3) is loaded with optimum-intel's own LlamaEagle3ForCausalLM and
exported with its exporter: optimum-cli reaches that class only through transformers' remote-code path
(--trust-remote-code), whose import check then demands diffusers, which needs a newer transformers than
optimum-intel 2.2 allows. The draft keeps the embedding the folder carries (`--engine openvino`).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    archs = json.loads((src / "config.json").read_text()).get("architectures") or []
    if not any("Eagle3" in a for a in archs):
        cli = Path(sys.executable).parent / "optimum-cli"
        sys.exit(subprocess.call([str(cli), "export", "openvino", "--model", str(src), "--task",
                                  "text-generation-with-past", "--weight-format", "fp32", str(out)]))
    import torch
    from optimum.exporters.openvino import export_from_model
    from optimum.exporters.openvino.model_patcher import LlamaEagle3ForCausalLM
    from optimum.intel import OVConfig
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = False
    model = LlamaEagle3ForCausalLM.from_pretrained(src, config=config, torch_dtype=torch.float32).eval()
    # named as the remote-code path names it (after loading: transformers looks the module up while loading):
    # optimum then takes it for the transformers model it is
    LlamaEagle3ForCausalLM.__module__ = "transformers_modules.llama_eagle3"
    export_from_model(model, out, task="text-generation-with-past", ov_config=OVConfig(dtype="fp32"))
    try:
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
    except Exception:      # a draft folder need not carry a tokenizer: GenAI uses the target's
        pass


if __name__ == "__main__":
    main()
