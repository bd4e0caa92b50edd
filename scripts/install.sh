#!/usr/bin/env bash
# Install Kvasir and its pinned llama.cpp build on this machine (Linux/macOS/Termux).
#
#   scripts/install.sh [EXTRAS]      EXTRAS: demo (default), test, or e.g. "demo,test"
#
# llama-cpp-python is built from source once per set of build flags and kept as a wheel under
# ~/.cache/kvasir/wheels/<flags hash>/ (pass CMAKE_ARGS, e.g. -DGGML_CUDA=on, for another backend). On x86_64 the build
# targets AVX2/FMA/F16C instead of -march=native: ggml's native build enables the AMX kernels on CPUs that report
# AMX, and those crash in VMs that do not grant AMX tile state (seen on our CI machines).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-demo}"
py="${PYTHON:-python3}"
case "$(uname -m)" in
    x86_64|amd64)
        export CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" ;;
esac
key=$(printf '%s' "${CMAKE_ARGS:-}" | "$py" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:12])')
wheels="${KVASIR_WHEEL_DIR:-$HOME/.cache/kvasir/wheels}/$key"
mkdir -p "$wheels"
if ! ls "$wheels"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python 0.3.36 (about 8 minutes on 2 cores; cached in $wheels)" >&2
    "$py" -m pip wheel --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==0.3.36"
fi
"$py" -m pip install -q "$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -n 1)"
# The test extra installs under constraints/dev.txt: exact linter, type checker, Textual and test-tool versions, so a
# new release cannot fail the suite without a code change. Bump them there, deliberately.
constraints=""
case ",${extras}," in *,test,*) constraints="constraints/dev.txt" ;; esac
"$py" -m pip install -q ${constraints:+-c "$constraints"} -e ".[${extras}]"
# pyenv installs console scripts behind shims that exist only after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
