"""The target model: loading it (an alias, a GGUF, a folder or a hub id: loading.py), the wrapper every loop
calls (model.py: prefill, tree-masked verify forwards, feature taps), and its lm_head (lm_head.py: projecting
only the rows a step reads)."""
