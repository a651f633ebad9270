"""The OpenAI-compatible HTTP API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A thin edge over the gRPC servicer (``GenerationServicer.generate`` / ``stream``): the same runtime, checks, API
keys, TLS files, error tree and request metrics; OpenAI JSON becomes the gRPC request messages (``params``) and
their replies become OpenAI bodies (``replies``). It never generates on its own path.
"""

from service.api.http.app import OpenAIRoutes
from service.api.http.listener import HttpListener

__all__ = ["HttpListener", "OpenAIRoutes"]
