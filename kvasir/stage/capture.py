"""Copying the boundary (``l_out-{n-1}``) out of llama.cpp's graph with an eval callback.

ggml's scheduler calls the callback for every node of the graph: "do you want this one?" and, for a yes, again once
it is computed. Hundreds of nodes per decode make a Python callback cost ~1 ms a token, so the callback is a few
lines of C (``native/capture.c``) compiled once with the system's C compiler — one exists wherever
llama-cpp-python was built from source. A package build may compile it ahead of time (``native/capture.so``
beside the source; flake.nix does, so no compiler sits in the runtime closure). Without a compiler the same logic runs
in Python.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvasir.stage.llama_ffi import GGML_TYPE_F32, NAME_OFFSET, GgmlTensor, runtime

log = logging.getLogger("kvasir.stage")
_SOURCE = Path(__file__).with_name("native") / "capture.c"


class Capture(Protocol):
    """An armed eval callback: ``callback``/``user_data`` go into llama.cpp's context params."""

    callback: Any
    user_data: ctypes.c_void_p | None

    def begin(self, dst: np.ndarray[Any, np.dtype[np.float32]]) -> None: ...

    def rows(self) -> int:
        """Rows copied since :meth:`begin`; -1 if the node had an unexpected shape or type."""
        ...


class _NativeStruct(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * 64),
        ("name_offset", ctypes.c_size_t),
        ("type_offset", ctypes.c_size_t),
        ("ne_offset", ctypes.c_size_t),
        ("tensor_get", ctypes.c_void_p),
        ("dst", ctypes.c_void_p),
        ("capacity_rows", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("n_embd", ctypes.c_int64),
    ]


class NativeCapture:
    def __init__(self, lib: ctypes.CDLL, node: str, n_embd: int) -> None:
        rt = runtime()
        self._struct = _NativeStruct(
            name=node.encode(),
            name_offset=NAME_OFFSET,
            type_offset=GgmlTensor.type.offset,
            ne_offset=GgmlTensor.ne.offset,
            tensor_get=ctypes.cast(rt.ggml_base.ggml_backend_tensor_get, ctypes.c_void_p).value,
            n_embd=n_embd,
        )
        address = ctypes.cast(lib.kvasir_capture_eval, ctypes.c_void_p).value
        self.callback: Any = rt.llama.ggml_backend_sched_eval_callback(address)
        self.user_data: ctypes.c_void_p | None = ctypes.cast(ctypes.pointer(self._struct), ctypes.c_void_p)
        self._lib = lib  # keep the code loaded as long as the callback may run
        self._dst: np.ndarray[Any, np.dtype[np.float32]] | None = None

    def begin(self, dst: np.ndarray[Any, np.dtype[np.float32]]) -> None:
        self._dst = dst  # keep the buffer alive while C writes into it
        self._struct.dst = dst.ctypes.data
        self._struct.capacity_rows = dst.shape[0]
        self._struct.rows = 0

    def rows(self) -> int:
        return int(self._struct.rows)


class PythonCapture:
    def __init__(self, node: str, n_embd: int) -> None:
        target = node.encode() + b"\0"
        size = len(target)
        get = runtime().ggml_base.ggml_backend_tensor_get
        self._rows = 0
        self._dst: np.ndarray[Any, np.dtype[np.float32]] = np.zeros((0, n_embd), np.float32)

        def on_eval(t: int, ask: bool, _user: Any) -> bool:
            if ctypes.string_at(t + NAME_OFFSET, size) != target:
                return not ask
            if ask:
                return True
            tensor = GgmlTensor.from_address(t)
            rows = int(tensor.ne[1])
            fits = self._rows >= 0 and self._rows + rows <= len(self._dst)
            if not fits or tensor.type != GGML_TYPE_F32 or int(tensor.ne[0]) != n_embd:
                self._rows = -1
            else:
                get(t, self._dst[self._rows :].ctypes.data, 0, rows * n_embd * 4)
                self._rows += rows
            return True  # raising through C is not an option: errors are reported by rows()

        self.callback: Any = runtime().llama.ggml_backend_sched_eval_callback(on_eval)
        self.user_data: ctypes.c_void_p | None = None

    def begin(self, dst: np.ndarray[Any, np.dtype[np.float32]]) -> None:
        self._dst = dst
        self._rows = 0

    def rows(self) -> int:
        return self._rows


def make_capture(node: str, n_embd: int, cache_dir: Path, *, native: bool = True) -> Capture:
    lib = _native_library(cache_dir) if native else None
    return NativeCapture(lib, node, n_embd) if lib is not None else PythonCapture(node, n_embd)


_loaded: dict[Path, ctypes.CDLL | None] = {}


def _native_library(cache_dir: Path, source_path: Path = _SOURCE) -> ctypes.CDLL | None:
    """The compiled callback, or None (and the Python callback) without its source, a compiler or a loadable .so."""
    try:
        source = source_path.read_bytes()  # a broken install may lack it: slower, not dead
    except OSError as exc:
        log.warning("no C boundary capture source (%s); using the slower Python callback", exc)
        return None
    prebuilt = source_path.with_suffix(".so")  # compiled at package build time (flake.nix): no compiler at run time
    if prebuilt.exists():
        return _load(prebuilt)
    key = hashlib.sha256(source + platform.platform().encode()).hexdigest()[:16]
    target = cache_dir / "native" / f"capture-{key}.so"
    if target not in _loaded and not target.exists():
        try:
            _compile(target, source_path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("no C boundary capture (%s); using the slower Python callback", exc)
            _loaded[target] = None
    return _load(target)


def _load(library: Path) -> ctypes.CDLL | None:
    if library not in _loaded:
        try:
            _loaded[library] = ctypes.CDLL(str(library))
        except OSError as exc:
            log.warning("no C boundary capture (%s); using the slower Python callback", exc)
            _loaded[library] = None
    return _loaded[library]


def _compile(target: Path, source_path: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        cc = os.environ.get("CC", "cc")
        subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(source_path)], check=True, capture_output=True, timeout=120
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
