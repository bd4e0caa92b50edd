#!/usr/bin/env bash
# Install Kvasir and its pinned llama.cpp build on this machine (Linux/macOS/Termux).
#
# llama-cpp-python is built from source once and kept as a wheel in ~/.cache/kvasir/wheels. On x86_64 the build
# targets AVX2/FMA/F16C instead of -march=native: ggml's native build enables the AMX kernels on CPUs that report
# AMX, and those crash in VMs that do not grant AMX tile state (seen on our CI machines).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-demo}"
py="${PYTHON:-python3}"
wheels="${KVASIR_WHEEL_DIR:-$HOME/.cache/kvasir/wheels}"
mkdir -p "$wheels"
if ! ls "$wheels"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
    case "$(uname -m)" in
        x86_64|amd64)
            export CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" ;;
    esac
    echo "building llama-cpp-python 0.3.36 (about 8 minutes on 2 cores; cached afterwards)" >&2
    "$py" -m pip wheel --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==0.3.36"
fi
"$py" -m pip install -q "$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -n 1)"
"$py" -m pip install -q -e ".[${extras}]"
# pyenv installs console scripts behind shims that exist only after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
