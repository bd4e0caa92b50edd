"""Clients people already have, against the OpenAI-compatible API of a live 3-node ring: plain ``curl -N`` reading
server-sent events, and the ``llm`` command-line tool with the ring configured as an OpenAI-compatible model."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasir.local.launcher import free_ports
from tests.ringutil import running_ring

PROMPT = "The ring passes the hidden state on"


@pytest.fixture(scope="module")
def base_url(tiny_model: Callable[..., Path], cache_dir: Path) -> Iterator[str]:
    """One ring for the module's clients (its start is most of their time)."""
    (port,) = free_ports(1)
    with running_ring(tiny_model("llama", "f32"), [(0, 2), (2, 4), (4, 6)], cache_dir, api_port=port):
        yield f"http://127.0.0.1:{port}/v1"


def reference(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request, not streamed, through httpx: what each client must reproduce."""
    r = httpx.post(f"{base_url}/{path}", json=body, timeout=60)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events(base_url: str) -> None:
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    curl = ["curl", "-sS", "-N", "--fail-with-body", "-H", "Content-Type: application/json"]
    r = subprocess.run(
        [*curl, "-d", json.dumps(body), f"{base_url}/completions"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    # SSE framing: `data: ...` lines, each event ended by a blank line, the stream by `data: [DONE]`.
    events = [e for e in r.stdout.split("\n\n") if e.strip()]
    assert events and all(e.startswith("data: ") and "\n" not in e for e in events), r.stdout
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    done = reference(base_url, "completions", {**body, "stream": False})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == done["choices"][0]["text"]


def _llm_command() -> list[str] | None:
    if importlib.util.find_spec("llm") is not None:
        return [sys.executable, "-m", "llm"]
    found = shutil.which("llm")
    return [found] if found else None


LLM = _llm_command()


@pytest.mark.skipif(LLM is None, reason="the `llm` tool is not installed (pip install llm; it is in the test extra)")
@pytest.mark.parametrize("completion", [False, True], ids=["chat", "completion"])
def test_llm_tool_as_an_openai_compatible_model(base_url: str, tmp_path: Path, completion: bool) -> None:
    assert LLM is not None
    # llm reads extra OpenAI-compatible models from this file in its user directory (LLM_USER_PATH).
    entry: dict[str, object] = {
        "model_id": "kvasir-ring",
        "model_name": "x",
        "api_base": base_url,
        "api_key_name": "kvasir",
    }
    if completion:
        entry["completion"] = True
    (tmp_path / "extra-openai-models.yaml").write_text(json.dumps([entry]))  # JSON is YAML
    (tmp_path / "keys.json").write_text(json.dumps({"kvasir": "no-key-needed-on-loopback"}))  # `llm keys set kvasir`
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path)}
    env.pop("OPENAI_API_KEY", None)
    r = subprocess.run(
        [*LLM, "-m", "kvasir-ring", "--no-log", "-o", "temperature", "0", "-o", "max_tokens", "6", PROMPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    params = {"model": "x", "max_tokens": 6, "temperature": 0}
    if completion:
        want = reference(base_url, "completions", {**params, "prompt": PROMPT})["choices"][0]["text"]
    else:
        chat = reference(base_url, "chat/completions", {**params, "messages": [{"role": "user", "content": PROMPT}]})
        want = chat["choices"][0]["message"]["content"]
    assert want and r.stdout == want + "\n"
