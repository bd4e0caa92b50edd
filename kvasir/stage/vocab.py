"""Tokenization and detokenization exactly as llama.cpp does them, on any stage.

A stage whose file carries a stub vocabulary (every window but the last) keeps the model's real tokenizer under
``kvasir.tokenizer.*``; it is loaded here as a vocab-only llama.cpp model from a throwaway GGUF holding only metadata.
"""

from __future__ import annotations

import codecs
import ctypes
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from gguf import GGUFValueType

from kvasir.core.errors import InputError, StageError
from kvasir.shard.gguf_file import TOKENIZER_STASH_PREFIX
from kvasir.shard.gguf_io import GGUFFile, encode_kv, write_gguf
from kvasir.stage.chat_template import render_chat
from kvasir.stage.llama_ffi import runtime

#: Built-in llama.cpp chat templates for models whose GGUF carries none (Gemma 3 270M ships without one).
_FALLBACK_TEMPLATE = {"gemma3": "gemma", "gemma2": "gemma", "llama": "llama3", "qwen2": "chatml", "qwen3": "chatml"}


class Vocab:
    def __init__(self, model: Any, arch: str, owns_model: bool) -> None:
        self._L = runtime().llama
        self._model = model
        self._owns = owns_model
        self._vocab = self._L.llama_model_get_vocab(model)
        self.arch = arch
        self.n_tokens = int(self._L.llama_vocab_n_tokens(self._vocab))
        self._pieces: dict[int, bytes] = {}
        self._longest: int | None = None

    @classmethod
    def from_stashed(cls, gg: GGUFFile, arch: str) -> Vocab:
        """Load the real tokenizer stashed in a stub-vocabulary stage file."""
        L = runtime().llama
        kvs = []
        for key, kv in gg.kvs.items():
            if key.startswith(("tokenizer.", "kvasir.stage.")) or key in (f"{arch}.vocab_size", "general.architecture"):
                continue
            if key.startswith(TOKENIZER_STASH_PREFIX + "tokenizer."):
                kv = kv.renamed(key[len(TOKENIZER_STASH_PREFIX) :])
            kvs.append(kv)
        if not any(kv.key == "tokenizer.ggml.model" for kv in kvs):
            raise StageError(f"{gg.path}: stage file carries no tokenizer")
        kvs.append(encode_kv("general.architecture", arch, GGUFValueType.STRING))
        with tempfile.TemporaryDirectory(prefix="kvasir-vocab-") as tmp:
            path = Path(tmp) / "vocab.gguf"
            with path.open("wb") as fh:
                write_gguf(fh, kvs, [])
            mp = L.llama_model_default_params()
            mp.vocab_only = True
            model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise StageError(f"{gg.path}: llama.cpp could not load the stashed tokenizer")
        return cls(model, arch, owns_model=True)

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (ctypes.c_int32 * cap)()
        n = self._L.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ctypes.c_int32 * cap)()
            n = self._L.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise InputError("prompt could not be tokenized")
        return list(buf[:n])

    @property
    def bos(self) -> int:
        return int(self._L.llama_vocab_bos(self._vocab))

    @property
    def eos(self) -> int:
        return int(self._L.llama_vocab_eos(self._vocab))

    def token_text(self, token: int) -> str:
        """A token's text in the vocabulary (``<|im_end|>`` for a special token); "" for no token (-1)."""
        if not 0 <= token < self.n_tokens:
            return ""
        return bytes(self._L.llama_vocab_get_text(self._vocab, token)).decode("utf-8", "replace")

    def piece(self, token: int) -> bytes:
        """The bytes a token contributes to the text (special tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        if not 0 <= token < self.n_tokens:  # llama.cpp throws through its C API (the process aborts)
            raise InputError(f"token id {token} out of range [0, {self.n_tokens})")
        buf = ctypes.create_string_buffer(64)
        n = self._L.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._L.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
        out = buf.raw[: max(n, 0)]
        self._pieces[token] = out
        return out

    def longest_piece(self) -> int:
        """Bytes of the longest token text (at least 1): a text of N bytes is at least N / this many tokens."""
        if self._longest is None:
            buf = ctypes.create_string_buffer(256)
            longest = 1
            for token in range(self.n_tokens):  # uncached: holding every piece would cost megabytes
                n = self._L.llama_token_to_piece(self._vocab, token, buf, 256, 0, True)
                longest = max(longest, abs(n))  # negative: the piece needs -n bytes
            self._longest = longest
        return self._longest

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._L.llama_vocab_is_eog(self._vocab, token))

    def check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.n_tokens]
        if bad:
            raise InputError(f"token id {bad[0]} out of range [0, {self.n_tokens})")

    def chat_tokens(self, messages: Sequence[tuple[str, str]], template: str | None) -> list[int]:
        """The prompt tokens of (role, content) messages: every chat path (API, control socket, ``generate --chat``)
        comes here.

        With the model's own template: rendered as llama-cpp-python's ``create_chat_completion`` renders it
        (:func:`render_chat`) and tokenized as it does: special-token text parsed, nothing added (``add_bos=False``:
        a template that wants BOS writes ``bos_token`` itself). Without one: llama.cpp's built-in template for the
        architecture (:meth:`_builtin_chat_tokens`).
        """
        if template is None:
            return self._builtin_chat_tokens(messages)
        text = render_chat(template, messages, bos_token=self.token_text(self.bos), eos_token=self.token_text(self.eos))
        return self.tokenize(text, add_special=False, parse_special=True)

    def _builtin_chat_tokens(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """llama.cpp's built-in template (C ``llama_chat_apply_template``), tokenized with special-token text parsed
        and BOS added: the built-in templates never write BOS, and without it Gemma 3 answers with blank lines."""
        template = _FALLBACK_TEMPLATE.get(self.arch, "chatml")
        keep = [(r.encode(), c.encode()) for r, c in messages]
        arr = (self._L.llama_chat_message * len(keep))()
        for i, (r, c) in enumerate(keep):
            arr[i].role = r
            arr[i].content = c
        size = 256 + sum(len(c) for _, c in keep) * 2
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = self._L.llama_chat_apply_template(template.encode(), arr, len(keep), True, buf, size)
            if n < 0:
                raise InputError(f"chat template {template!r} is not supported by llama.cpp")
            if n <= size:
                return self.tokenize(buf.raw[:n].decode("utf-8", "replace"), add_special=True, parse_special=True)
            size = n + 1
        raise InputError("chat template output too large")  # pragma: no cover

    def close(self) -> None:
        if self._owns and self._model is not None:
            self._L.llama_model_free(self._model)
        self._model = None


class PieceSource(Protocol):
    def piece(self, token: int) -> bytes: ...


class TextStream:
    """Turns a token stream into text deltas without splitting multi-byte UTF-8 characters."""

    def __init__(self, vocab: PieceSource) -> None:
        self._vocab = vocab
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self._decoder.decode(self._vocab.piece(token))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
