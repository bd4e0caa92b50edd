"""The kernel class: the conditions under which a window's output bits are a function of its inputs alone.

Measured (docs/verification.md, bench/kernel_class.py): on one CPU build the output depends on the window, the input
boundaries and the chunk schedule; thread count, sequence slot, neighbours and n_ctx do not change a bit. So the
class names what can change the arithmetic: the llama.cpp build (its version and the ggml feature flags it was
compiled with), the backend that runs the layers, and the stage recipe. The schedule travels with each receipt.
"""

from __future__ import annotations

import hashlib

from kvasir.stage.engine import Stage
from kvasir.stage.llama_ffi import runtime

#: Bump when the stage recipe changes how a window computes (docs/stage-gguf.md).
RECIPE_VERSION = 1


def kernel_class(backend: str = "CPU") -> str:
    """``<backend>-<16 hex>``: the backend, then a digest of the llama.cpp version, ggml flags and recipe."""
    llama = runtime().llama  # the llama_cpp module: only kvasir.stage imports it
    flags = llama.llama_print_system_info()
    text = flags.decode(errors="replace") if isinstance(flags, bytes) else str(flags)
    digest = hashlib.sha256(f"{llama.__version__}\n{text}\nrecipe {RECIPE_VERSION}".encode()).hexdigest()[:16]
    return f"{backend}-{digest}"


def stage_kernel_class(stage: Stage) -> str:
    return kernel_class(stage.info.backend)
