#!/usr/bin/env bash
# Set up Kvasir on an Android phone in Termux (from F-Droid or GitHub, not the Play Store build). See docs/termux.md.
#
#   scripts/termux-setup.sh [EXTRAS]     EXTRAS as for scripts/install.sh (default: none, the phone profile: Kvasir
#                                        alone, no demo models; a phone serves one window of a model it is given)
#
# Termux's packages provide what pip cannot build on Android: numpy (python-numpy), cryptography
# (python-cryptography: PyPI has no Android wheel and building it needs Rust), pip itself (python-pip), the compiler
# and build tools for llama.cpp (clang, cmake, ninja; scikit-build-core would otherwise try to build ninja from
# source), and libandroid-spawn (posix_spawn for llama.cpp's tools). scripts/install.sh makes a venv that sees these
# system packages, then builds the pinned llama-cpp-python on the device with its Android loader patch and OpenMP
# off.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -o 2>/dev/null)" != Android ] && [ -z "${TERMUX_VERSION:-}" ]; then
    echo "termux-setup.sh: this is not Termux (use scripts/install.sh)" >&2
    exit 2
fi
pkg update -y
pkg install -y python python-pip python-numpy python-cryptography clang cmake ninja make git binutils libandroid-spawn
# Python in Termux finds numpy from python-numpy; pip must not replace it with a source build.
scripts/install.sh "${1:-}"
# Android has no /tmp and Termux sets no XDG_RUNTIME_DIR: give the control sockets a runtime directory in Termux's own
# tree (kvasir creates $XDG_RUNTIME_DIR/kvasir with mode 0700).
if [ -z "${XDG_RUNTIME_DIR:-}" ] && ! grep -q "kvasir: runtime dir" "$HOME/.bashrc" 2>/dev/null; then
    echo 'export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$PREFIX/var/run}"  # kvasir: runtime dir' >> "$HOME/.bashrc"
    mkdir -p "$PREFIX/var/run"
fi
# A ring node is a long-running process: keep the CPU awake while this session runs (undo: termux-wake-unlock).
if command -v termux-wake-lock >/dev/null 2>&1; then termux-wake-lock || true; fi
cat <<'EOF'
Kvasir is installed. Before joining a ring, read docs/termux.md: turn off battery optimisation for Termux and, on
Android 12 or newer, the phantom-process killer; pass --threads with the number of big cores.
EOF
