"""OpenAI-compatible HTTP API of a ring node: ``serve_api(node, host, port)`` (docs/api.md)."""

from kvasir.api.backend import ApiBackend
from kvasir.api.server import ApiAccess, serve_api
from kvasir.net.http import ApiLimits

__all__ = ["ApiAccess", "ApiBackend", "ApiLimits", "serve_api"]
