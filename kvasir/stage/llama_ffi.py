"""The few llama.cpp / ggml entry points the stage engine needs beyond llama-cpp-python's bindings.

Nothing happens at import: :func:`runtime` loads the libraries and initialises the backend on first use.
llama-cpp-python's ctypes functions come from ``ctypes.CDLL``, so every call releases the GIL while it runs.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import Any

import attrs

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64
GGML_TYPE_F32 = 0


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of the ggml llama-cpp-python 0.3.36 bundles (checked against ggml_get_name)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


NAME_OFFSET: int = GgmlTensor.name.offset


@attrs.frozen
class Runtime:
    llama: Any  # the llama_cpp module
    #: llama_cpp.llama_cpp_ext: llama.cpp's staging API (the nextn/MTP entry points), bound by llama-cpp-python.
    llama_ext: Any
    ggml_base: ctypes.CDLL
    ggml: ctypes.CDLL
    devices: tuple[str, ...]


_log_keepalive: list[Any] = []
_init_lock = threading.Lock()


@functools.cache
def runtime() -> Runtime:
    """Load llama.cpp, silence its logging below errors, initialise backends; once per process."""
    with _init_lock:
        import llama_cpp
        import llama_cpp.llama_cpp_ext as llama_ext

        lib_dir = Path(llama_cpp.__file__).parent / "lib"
        base = ctypes.CDLL(str(_find(lib_dir, "libggml-base")))
        ggml = ctypes.CDLL(str(_find(lib_dir, "libggml")))
        base.ggml_backend_tensor_get.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
        ]
        base.ggml_backend_tensor_get.restype = None
        base.ggml_get_name.argtypes = [ctypes.c_void_p]
        base.ggml_get_name.restype = ctypes.c_char_p
        base.ggml_nbytes.argtypes = [ctypes.c_void_p]
        base.ggml_nbytes.restype = ctypes.c_size_t

        @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
        def _log(level: int, text: bytes, _user: Any) -> None:
            # GGML_LOG_LEVEL_ERROR = 4; the rest is load chatter a user of `kvasir` should not see.
            if level == 4:
                import sys

                sys.stderr.write(text.decode("utf-8", "replace"))

        _log_keepalive.append(_log)
        llama_cpp.llama_log_set(_log, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        return Runtime(llama=llama_cpp, llama_ext=llama_ext, ggml_base=base, ggml=ggml, devices=_devices(ggml))


def _find(lib_dir: Path, stem: str) -> Path:
    for name in (f"{stem}.so", f"{stem}.dylib", f"{stem}.dll"):
        if (lib_dir / name).exists():
            return lib_dir / name
    matches = sorted(lib_dir.glob(f"{stem}.*"))
    if not matches:
        raise OSError(f"{stem} not found next to libllama in {lib_dir}")
    return matches[0]


def _devices(ggml: ctypes.CDLL) -> tuple[str, ...]:
    """Names of the ggml backend devices this build can use (e.g. ``("CPU",)`` or ``("CUDA0", "CPU")``)."""
    try:
        ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
        ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
        ggml.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_dev_name.restype = ctypes.c_char_p
        n = int(ggml.ggml_backend_dev_count())
        return tuple((ggml.ggml_backend_dev_name(ggml.ggml_backend_dev_get(i)) or b"?").decode() for i in range(n))
    except AttributeError:  # pragma: no cover - older ggml
        return ("CPU",)
