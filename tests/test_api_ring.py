"""The OpenAI-compatible API on a real ring of node processes, driven by the official openai client."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from kvasir.local.launcher import free_ports
from tests.ringutil import running_ring, whole_model

PROMPT = "The ring passes the hidden state on"


def test_openai_client_against_a_live_ring(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("llama", "f32")
    (port,) = free_ports(1)
    with running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir, api_port=port) as ring:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
        models = client.models.list()
        assert [m.id for m in models.data] == [ring.manifest.model_name]

        done = client.completions.create(model="x", prompt=PROMPT, max_tokens=10, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 10
        text = done.choices[0].text
        assert done.choices[0].finish_reason == "length"

        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(model="x", prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
            if chunk.choices
        )
        assert streamed == text

        chat = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage is not None
        parts = list(
            client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, stream=True
            )
        )
        assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content

        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="x", prompt=PROMPT, max_tokens=10_000)
    # The API's greedy text is the whole model's greedy text.
    assert text == whole_model(model, PROMPT, 10).text


def test_api_keys_on_a_live_ring(tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path) -> None:
    model = tiny_model("llama", "f32")
    (port,) = free_ports(1)
    keys = tmp_path / "api-keys"
    keys.write_text("# users\nkey-for-alice-0123456789\n")
    keys.chmod(0o600)
    with running_ring(model, [(0, 3), (3, 6)], cache_dir, api_port=port, api_key_file=keys):
        base = f"http://127.0.0.1:{port}/v1"
        stranger = openai.OpenAI(base_url=base, api_key="guess-0123456789abcdef", timeout=60, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.completions.create(model="x", prompt=PROMPT, max_tokens=4, temperature=0)
        alice = openai.OpenAI(base_url=base, api_key="key-for-alice-0123456789", timeout=60, max_retries=0)
        done = alice.completions.create(model="x", prompt=PROMPT, max_tokens=4, temperature=0)
    assert done.choices[0].text == whole_model(model, PROMPT, 4).text
