"""OpenAI request bodies in, OpenAI-shaped response objects out (pure: no I/O, no backend).

Fields the API cannot honour are refused with a 400 rather than silently ignored, except the few that clients
send by habit and whose neutral value changes nothing (see docs/api.md).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from kvasir.core.sampling import SamplingError, SamplingParams
from kvasir.core.schema import SchemaError, register_record, structure
from kvasir.core.validators import int_in
from kvasir.wire.frames import MAX_DRAFTS, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_STOP_BYTES, MAX_STOP_STRINGS

Json = dict[str, Any]
Kind = Literal["completion", "chat"]

#: OpenAI's default for ``max_tokens`` on the legacy completions endpoint.
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: Chat roles passed to the chat template as they are; ``developer`` (OpenAI's newer name) becomes ``system``.
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

FINISH_REASONS = {"eog": "stop", "stop": "stop", "max_tokens": "length"}


class ApiError(Exception):
    """An error reply: HTTP status plus OpenAI's ``{"error": {message, type, param, code}}`` body."""

    def __init__(
        self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @classmethod
    def invalid(cls, message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
        return cls(400, message, type="invalid_request_error", param=param, code=code)

    def body(self) -> Json:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@attrs.frozen
class GenerationRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` body."""

    kind: Kind
    #: completions: the prompt text, or token ids given directly; chat: None
    prompt: str | tuple[int, ...] | None
    #: chat: (role, content) pairs for the chat template; completions: empty
    messages: tuple[tuple[str, str], ...]
    params: SamplingParams
    #: None: as much as the context leaves (chat only)
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    #: Kvasir's extension: speculative decoding with up to this many drafts per step (None: the node's default).
    speculate: int | None = None


def new_id(kind: Kind) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + secrets.token_hex(12)


# ---------------------------------------------------------------------------------------------------- parsing


_token_count = int_in(1, MAX_NEW_TOKENS, optional=True)
_speculate = int_in(0, MAX_DRAFTS, optional=True)


@attrs.frozen
class _StreamOptions:
    include_usage: bool = False


@attrs.frozen
class _Options:
    """The plainly typed fields of a generation body (the OpenAI unions, prompt, messages and stop, are parsed by
    hand below); unknown keys are left to :func:`_refuse_unsupported`."""

    model: str | None = None
    max_tokens: int | None = attrs.field(default=None, validator=_token_count)
    max_completion_tokens: int | None = attrs.field(default=None, validator=_token_count)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    speculate: int | None = attrs.field(default=None, validator=_speculate)


register_record(_StreamOptions)
register_record(_Options)


def _parse_options(body: Mapping[str, Any]) -> _Options:
    # JSON null means "not given" in OpenAI's API.
    try:
        return structure({k: v for k, v in body.items() if v is not None}, _Options, where="body")
    except SchemaError as exc:
        raise ApiError.invalid(f"'{exc.path}' {exc.reason}" if exc.path else exc.reason, param=exc.path) from None


def parse_generation(kind: Kind, body: object) -> GenerationRequest:
    if not isinstance(body, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    options = _parse_options(body)
    _refuse_unsupported(kind, body)
    if kind == "completion":
        prompt = _parse_prompt(body)
        messages: tuple[tuple[str, str], ...] = ()
        max_tokens: int | None = options.max_tokens if options.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    else:
        prompt = None
        messages = _parse_messages(body)
        max_tokens = options.max_completion_tokens if options.max_completion_tokens is not None else options.max_tokens
    include_usage = options.stream_options is not None and options.stream_options.include_usage
    return GenerationRequest(
        kind=kind,
        prompt=prompt,
        messages=messages,
        params=_parse_sampling(body),
        max_tokens=max_tokens,
        stop=_parse_stop(body),
        stream=options.stream,
        include_usage=include_usage and options.stream,
        speculate=options.speculate,
    )


def _refuse_unsupported(kind: Kind, body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise ApiError.invalid("only n=1 is supported", param="n")
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != 1):
        raise ApiError.invalid("only best_of=1 is supported", param="best_of")
    if kind == "completion":
        if body.get("echo"):
            raise ApiError.invalid("'echo' is not supported", param="echo")
        if body.get("suffix"):
            raise ApiError.invalid("'suffix' is not supported", param="suffix")
        if body.get("logprobs") is not None:
            raise ApiError.invalid("'logprobs' is not supported", param="logprobs")
    else:
        if body.get("logprobs"):
            raise ApiError.invalid("'logprobs' is not supported", param="logprobs")
        for name in ("tools", "functions"):
            if body.get(name):
                raise ApiError.invalid(f"'{name}' is not supported", param=name)
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise ApiError.invalid("only response_format {'type': 'text'} is supported", param="response_format")
    if body.get("logit_bias"):
        raise ApiError.invalid("'logit_bias' is not supported", param="logit_bias")


def _parse_prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError.invalid("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        if len(prompt) > MAX_PROMPT_TOKENS:
            raise ApiError.invalid("'prompt' has too many tokens", param="prompt", code="context_length_exceeded")
        return tuple(prompt)
    raise ApiError.invalid(
        "'prompt' must be a string, a list with one string, or a non-empty list of token ids", param="prompt"
    )


def _parse_messages(body: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError.invalid("'messages' must be a non-empty array", param="messages")
    out: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ApiError.invalid(f"'{where}' must be an object", param=where)
        role = msg.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ApiError.invalid(
                f"'{where}.role' must be one of {', '.join(sorted(CHAT_ROLES))}", param=f"{where}.role"
            )
        out.append(("system" if role == "developer" else role, _content(msg.get("content"), f"{where}.content")))
    return tuple(out)


def _content(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError.invalid(f"'{where}[{j}]': only text content parts are supported", param=where)
            parts.append(_text(part["text"], where))
        return "".join(parts)
    raise ApiError.invalid(f"'{where}' must be a string or an array of text parts", param=where)


def _text(value: str, param: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError.invalid(f"'{param}' is not valid Unicode (lone surrogate)", param=param) from None
    return value


def _parse_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError.invalid("'stop' must be a string or an array of strings", param="stop")
    out = tuple(_text(s, "stop") for s in items if s)
    if len(out) > MAX_STOP_STRINGS:
        raise ApiError.invalid(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", param="stop")
    if any(len(s.encode("utf-8")) > MAX_STOP_BYTES for s in out):
        raise ApiError.invalid(f"each 'stop' string may be at most {MAX_STOP_BYTES} bytes", param="stop")
    return out


def _parse_sampling(body: Mapping[str, Any]) -> SamplingParams:
    try:
        return SamplingParams.OPENAI.with_fields(body)
    except SamplingError as exc:
        raise ApiError.invalid(str(exc), param=exc.field) from None


# ---------------------------------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_object(model: str, created: int) -> Json:
    return {"id": model, "object": "model", "created": created, "owned_by": "kvasir"}


def model_list(model: str, created: int) -> Json:
    return {"object": "list", "data": [model_object(model, created)]}


def response(kind: Kind, rid: str, created: int, model: str, text: str, finish: str, use: Json) -> Json:
    choice: Json
    if kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    else:
        message = {"role": "assistant", "content": text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use}


def chunk(
    kind: Kind,
    rid: str,
    created: int,
    model: str,
    *,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    include_usage: bool = False,
) -> Json:
    """One streamed chunk: a text delta, the chat's opening role delta, or the closing one with ``finish``."""
    choice: Json
    if kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    else:
        delta: Json = {}
        if role:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    out: Json = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(kind: Kind, rid: str, created: int, model: str, use: Json) -> Json:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
