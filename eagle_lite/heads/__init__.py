"""Draft heads as modules and as files: the EAGLE head (draft.py, with EAGLE-3's fused layer in eagle3_layer.py),
Medusa heads (medusa.py), and eagle_lite's own head folder (checkpoint.py: safetensors + config.json naming the
target). Folders in published layouts are read and written by formats/. The heads shipped with the package live
here too, one folder per target alias (smollm2/)."""
