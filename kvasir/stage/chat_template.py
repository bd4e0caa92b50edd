"""Chat prompts rendered from the GGUF's own ``tokenizer.chat_template``, as llama-cpp-python's
``Llama.create_chat_completion`` renders them (its ``Jinja2ChatFormatter``), so a ring answers a conversation
exactly as llama-cpp-python does with the same file.

The template is Hugging Face's chat-template dialect of Jinja, rendered in jinja2's immutable sandbox (a GGUF is a
download: its template must not reach Python objects) with the environment llama-cpp-python sets up: ``trim_blocks``
and ``lstrip_blocks``, the loop controls, a pass-through ``{% generation %}`` tag, ``tojson`` as ``json.dumps``
keeping non-ASCII, and the variables it passes: ``messages``, ``bos_token`` / ``eos_token`` (the vocabulary's token
texts), ``add_generation_prompt`` (true), ``raise_exception``, ``strftime_now`` and the tool fields (None). So the
template's own defaults apply: SmolLM2's adds its default system message when the conversation has none.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvasir.core.errors import InputError


class _TemplateRaised(Exception):
    """``raise_exception(message)`` called by the template (e.g. roles that do not alternate)."""


class _GenerationTag(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}…{% endgeneration %}`` marks assistant text for training: render the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API: a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Transformers' (and llama-cpp-python's) tojson: plain json.dumps, not jinja2's HTML-escaping one.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def render_chat(template: str, messages: Sequence[tuple[str, str]], *, bos_token: str, eos_token: str) -> str:
    """The prompt text of ``(role, content)`` messages under the Jinja chat ``template``, ending with the generation
    prompt (the assistant's turn opened). Raises InputError when the template does not compile or refuses the
    conversation."""
    try:
        compiled = _compiled(template)
        return compiled.render(
            messages=[{"role": role, "content": content} for role, content in messages],
            eos_token=eos_token,
            bos_token=bos_token,
            raise_exception=_raise,
            add_generation_prompt=True,
            functions=None,
            function_call=None,
            tools=None,
            tool_choice=None,
            strftime_now=_strftime_now,
        )
    except _TemplateRaised as exc:
        raise InputError(f"the model's chat template refused the conversation: {exc}") from None
    except jinja2.TemplateError as exc:
        raise InputError(f"the model's chat template failed: {exc}") from None
    except (TypeError, ValueError, LookupError, ArithmeticError) as exc:  # the template's own expressions
        raise InputError(f"the model's chat template failed: {type(exc).__name__}: {exc}") from None
