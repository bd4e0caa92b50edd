"""Chat prompts follow the GGUF's own template exactly as llama-cpp-python's ``create_chat_completion`` does: the
renderer against its ``Jinja2ChatFormatter``, and whole answers (prompt tokens, generated tokens, text) of
SmolLM2-135M-Instruct in process, through ``kvasir generate --chat``, and through a real ring's API and control
socket, against ``Llama.create_chat_completion`` on the same file."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import llama_cpp
import openai
import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from kvasir.core.errors import InputError
from kvasir.local.launcher import free_ports
from kvasir.stage.chat_template import render_chat
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.wire import SamplingParams
from tests.conftest import run_cli
from tests.ringutil import ring_generate, running_ring
from tests.test_chat_demo import chat_model

__all__ = ["chat_model"]  # a fixture used here

Messages = tuple[tuple[str, str], ...]

#: Four shapes of conversation. SmolLM2's template adds its own system message to those without one.
CONVERSATIONS: dict[str, Messages] = {
    "hi": (("user", "Hi"),),
    "system": (("system", "You are a pirate. Answer in one short sentence."), ("user", "Where is the treasure?")),
    "multi_turn": (("user", "What is 2 + 2?"), ("assistant", "2 + 2 = 4."), ("user", "And times 3?")),
    # Non-ASCII, emoji, a special token's text (parsed as the token by both, as create_chat_completion tokenizes
    # the whole rendered prompt with special=True), and 168 prompt tokens: three prefill chunks (64, 64, 40).
    "unicode_long": (
        (
            "user",
            "Résume en une phrase, s'il te plaît : « Le café naïf » — 日本語 🙂 <|im_start|> "
            + "The ring passes the hidden state from one stage to the next. " * 8,
        ),
    ),
}
MAX_TOKENS = 24
FINISH = {"eog": "stop", "max_tokens": "length"}

#: Exercises what the environment adds to plain Jinja: trim/lstrip of block lines, loop controls, the
#: {% generation %} tag, tojson keeping non-ASCII, the tool fields passed as None, bos/eos and the generation prompt.
FEATURES_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'system' %}{% continue %}{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% generation %}<{{ message['role'] }}>{{ message.content | tojson }}{% endgeneration %}
{% endfor %}
{% if tools is none and tool_choice is none and functions is none %}[no tools]{% endif %}
{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}"""


def as_dicts(messages: Sequence[tuple[str, str]]) -> list[Any]:
    """OpenAI's message objects (typed Any: they serve llama-cpp-python's and openai's own message types)."""
    return [{"role": role, "content": content} for role, content in messages]


# ---------------------------------------------------------------------------------------------------- the renderer


@pytest.mark.parametrize("name", ["smollm2", "tiny_gemma3", "features"])
def test_renders_as_llama_cpp_pythons_formatter(
    name: str, request: pytest.FixtureRequest, tiny_model: Any, cache_dir: Path
) -> None:
    if name == "features":
        template, bos, eos = FEATURES_TEMPLATE, "<s>", "</s>"
    else:
        path = request.getfixturevalue("chat_model") if name == "smollm2" else tiny_model("gemma3", "f32")
        with Stage.load(StageConfig(path, n_ctx=64, n_seq_max=1, n_threads=1)) as stage:
            found = stage.chat_template()
            assert found is not None
            template, bos, eos = found, stage.vocab.token_text(stage.vocab.bos), stage.vocab.token_text(stage.vocab.eos)
    formatter = Jinja2ChatFormatter(template, eos_token=eos, bos_token=bos)
    shapes = [*CONVERSATIONS.values(), (("system", "s"), ("user", "a"), ("assistant", "b"), ("user", "c café 🙂"))]
    for messages in shapes:
        expected = formatter(messages=as_dicts(messages)).prompt
        assert render_chat(template, messages, bos_token=bos, eos_token=eos) == expected
    if name == "smollm2":
        hi = render_chat(template, CONVERSATIONS["hi"], bos_token=bos, eos_token=eos)
        assert "You are a helpful AI assistant named SmolLM" in hi  # the template's own default system message


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("{{ raise_exception('roles must alternate') }}", "refused the conversation: roles must alternate"),
        ("{{ messages.append(1) }}", "unsafe"),  # the immutable sandbox: a template cannot change its input
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),  # nor reach Python's internals
        ("{% for m in messages %}", "failed"),  # unclosed block
        ("{{ messages[0].content + 1 }}", "TypeError"),
    ],
)
def test_a_template_that_fails_is_an_input_error(template: str, why: str) -> None:
    with pytest.raises(InputError, match=why):
        render_chat(template, [("user", "hi")], bos_token="<s>", eos_token="</s>")


# ---------------------------------------------------------------------------------------------------- answers


@attrs.frozen
class Answer:
    prompt: list[int]
    #: Generated tokens, the end-of-generation token left out (kvasir reports none for it).
    tokens: list[int]
    text: str
    finish: str


class _RecordingLlama(llama_cpp.Llama):
    """The real Llama, noting each token its sampler returns (the response itself carries only text)."""

    sampled: list[int]

    def sample(self, *args: Any, **kwargs: Any) -> int:
        token = int(super().sample(*args, **kwargs))
        self.sampled.append(token)
        return token


@pytest.fixture(scope="module")
def llm(chat_model: Path) -> Iterator[_RecordingLlama]:
    """llama-cpp-python on the chat model, set up as the stages compute (llama.cpp's last bits depend on it).

    The prompt is fed in 64-token batches (``n_batch=64``, so ``n_ubatch=64``), as kvasir prefills it (PREFILL_CHUNK,
    in process and on the ring); flash attention is on, as in a stage's context, which keeps llama.cpp's default
    ("auto": on for the CPU) where ``Llama`` turns it off unless asked (SmolLM2 then answers "Hi" differently);
    the same context length.
    """
    model = _RecordingLlama(
        model_path=str(chat_model),
        n_ctx=512,
        n_batch=64,
        n_threads=1,
        n_threads_batch=1,
        flash_attn=True,
        verbose=False,
    )
    yield model
    model.close()


def ask(llm: _RecordingLlama, messages: Messages, max_tokens: int) -> Answer:
    """``create_chat_completion`` at temperature 0; ``reset()`` first, so no conversation reuses the previous one's
    cached prefix (which would change how its prompt is batched)."""
    llm.sampled = []
    llm.reset()  # type: ignore[no-untyped-call]
    out: Any = llm.create_chat_completion(as_dicts(messages), temperature=0, max_tokens=max_tokens)
    (choice,) = out["choices"]
    usage = out["usage"]
    tokens = llm.sampled[: usage["completion_tokens"]]
    # Stopped: the last token sampled ended the generation and is not part of the answer.
    assert len(llm.sampled) == len(tokens) + (choice["finish_reason"] == "stop")
    prompt = list(llm.input_ids[: usage["prompt_tokens"]])
    return Answer(prompt, tokens, choice["message"]["content"], choice["finish_reason"])


@pytest.fixture(scope="module")
def reference(llm: _RecordingLlama) -> dict[str, Answer]:
    return {name: ask(llm, messages, MAX_TOKENS) for name, messages in CONVERSATIONS.items()}


def test_prompt_tokens_are_create_chat_completions(chat_model: Path, llm: _RecordingLlama) -> None:
    """Every chat path's prompt (Vocab.chat_tokens) is the one create_chat_completion feeds, for every shape."""
    with Stage.load(StageConfig(chat_model, n_ctx=64, n_seq_max=1, n_threads=1)) as stage:
        for name, messages in CONVERSATIONS.items():
            assert stage.vocab.chat_tokens(messages, stage.chat_template()) == ask(llm, messages, 1).prompt, name


def test_a_template_that_writes_bos_gets_one(tiny_model: Any) -> None:
    """The tiny Gemma 3's template starts with ``{{ bos_token }}`` and its vocabulary adds BOS: one BOS, as with
    create_chat_completion (SmolLM2 adds none, so it cannot tell)."""
    path = tiny_model("gemma3", "f32")
    messages = CONVERSATIONS["multi_turn"]
    tiny = _RecordingLlama(model_path=str(path), n_ctx=256, n_batch=64, n_threads=1, verbose=False)
    try:
        want = ask(tiny, messages, 1).prompt
    finally:
        tiny.close()
    with Stage.load(StageConfig(path, n_ctx=256, n_seq_max=1, n_threads=1)) as stage:
        got = stage.vocab.chat_tokens(messages, stage.chat_template())
        assert got == want and got.count(stage.vocab.bos) == 1 and got[0] == stage.vocab.bos


@pytest.mark.slow
def test_in_process_chat_is_create_chat_completions(chat_model: Path, reference: dict[str, Answer]) -> None:
    """What ``kvasir generate --chat`` runs (one stage, the whole model), for every shape of conversation."""
    with Stage.load(StageConfig(chat_model, n_ctx=512, n_seq_max=1, n_threads=1)) as stage:
        pipe = LocalPipeline([stage])
        for name, messages in CONVERSATIONS.items():
            want = reference[name]
            prompt = stage.vocab.chat_tokens(messages, stage.chat_template())
            assert prompt == want.prompt, name
            got = pipe.generate(prompt, SamplingParams(temperature=0.0), MAX_TOKENS)
            assert (got.tokens, got.text, FINISH[got.stop_reason]) == (want.tokens, want.text, want.finish), name


@pytest.mark.slow
def test_generate_chat_is_create_chat_completions(chat_model: Path, reference: dict[str, Answer]) -> None:
    want = reference["hi"]
    r = run_cli(
        "generate", str(chat_model), "--chat", "--prompt", "Hi", "--ctx=512", f"--max-tokens={MAX_TOKENS}", "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["tokens"], out["text"], FINISH[out["stop_reason"]]) == (want.tokens, want.text, want.finish)


@pytest.mark.slow
def test_a_ring_chats_as_create_chat_completion(
    chat_model: Path, reference: dict[str, Answer], cache_dir: Path
) -> None:
    """The API (every conversation) and the control socket's chat (the TUI chat pane's request) of a 2-node ring."""
    (port,) = free_ports(1)
    with running_ring(chat_model, [(0, 15), (15, 30)], cache_dir, api_port=port) as ring:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        for name, messages in CONVERSATIONS.items():
            want = reference[name]
            out = client.chat.completions.create(
                model="x", messages=as_dicts(messages), max_tokens=MAX_TOKENS, temperature=0
            )
            (choice,) = out.choices
            assert out.usage is not None
            got = (choice.message.content, choice.finish_reason, out.usage.prompt_tokens, out.usage.completion_tokens)
            assert got == (want.text, want.finish, len(want.prompt), len(want.tokens)), name
        end = ring_generate(ring.sockets[0], "Hi", MAX_TOKENS, chat=True)
    want = reference["hi"]
    assert (end["tokens"], end["text"], FINISH[end["reason"]]) == (want.tokens, want.text, want.finish)
    assert end["prompt_tokens"] == len(want.prompt)
