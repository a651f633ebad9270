"""The OpenAI-compatible HTTP API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A thin edge beside gRPC over the same frontend (``service.frontend.Frontend``): the same runtime, checks, API
keys, TLS files, error tree and call observer; OpenAI JSON becomes the frontend's domain call (``params``) and its
completions and events become OpenAI bodies (``replies``). No protobuf on this path.
"""

from service.api.http.app import OpenAIRoutes
from service.api.http.listener import HttpListener

__all__ = ["HttpListener", "OpenAIRoutes"]
