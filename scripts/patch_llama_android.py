"""Let llama-cpp-python 0.3.36 load its library on Android (Termux's Python 3.13: ``sys.platform == "android"``).

Its loader (``llama_cpp/_ctypes_extensions.py::load_shared_library``) knows linux/freebsd/darwin/win32/emscripten and
raises ``RuntimeError("Unsupported platform")`` for anything else. Android's libraries are ``lib*.so`` like Linux's,
so the patch adds "android" to the Linux branch. The pin stays 0.3.36: the stage recipe was validated on exactly that
version (docs/stage-gguf.md).

    python3 scripts/patch_llama_android.py SOURCE_DIR    # an unpacked sdist, or an installed site-packages dir

Idempotent; exits non-zero if the loader does not look as expected (a new version needs a new look, not a guess).
"""

from __future__ import annotations

import sys
from pathlib import Path

LOADER = Path("llama_cpp") / "_ctypes_extensions.py"
ORIGINAL = 'elif sys.platform.startswith("linux") or sys.platform.startswith("freebsd"):'
PATCHED = 'elif sys.platform.startswith(("linux", "freebsd", "android")):  # kvasir: Android patch'


def patch(root: Path) -> bool:
    """Patch ``root/llama_cpp/_ctypes_extensions.py``; True if it changed, False if it was already patched."""
    path = root / LOADER
    text = path.read_text()
    if PATCHED in text:
        return False
    if text.count(ORIGINAL) != 1:
        raise SystemExit(f"{path}: the Linux branch of the library loader is not where 0.3.36 has it; not patched")
    path.write_text(text.replace(ORIGINAL, PATCHED))
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    changed = patch(Path(argv[1]))
    print(f"{Path(argv[1]) / LOADER}: {'patched for Android' if changed else 'already patched'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
