"""The adapters seam both edges call: register and remove an adapter by id, every check written once.

gRPC's ``LoadAdapter`` / ``UnloadAdapter`` (``service.api.adapters``) and the HTTP edge's vLLM-compatible
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (``service.api.http.adapters``) only translate their
wire formats to these calls. Order, as both edges promise: the serving state (503 / UNAVAILABLE while loading or
draining), the id (``service.adapters.common.ids``), the source, the path policy (no ``--adapter-root`` = no
loading at all), then the catalog, which enforces the roots. ``field`` arguments name the request's own fields
in messages (``id`` / ``source`` for gRPC, ``lora_name`` / ``lora_path`` for HTTP).

It never builds a wire message, never counts a call and never reads a file on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, TypeVar

from service.adapters.catalog import AdapterCatalog
from service.adapters.common.ids import check_adapter_id
from service.errors import InvalidRequest, PermissionDenied
from service.hf_cache import parse_source

T = TypeVar("T")


class HasAdapters(Protocol):
    @property
    def adapters(self) -> AdapterCatalog: ...


class AdapterServing(Protocol):
    """What the seam needs of the runtime: its serving state, holding the adapter catalog."""

    def ready(self) -> HasAdapters: ...


class AdapterAdmin:
    def __init__(self, runtime: AdapterServing) -> None:
        self.runtime = runtime

    async def load(
        self, adapter_id: str, source: str, *, id_field: str = "id", source_field: str = "source"
    ) -> AdapterCatalog:
        """Register the folder (or ``hf://`` ref) ``source`` as ``adapter_id``; the catalog holding it is returned.
        Raises ``AlreadyExists`` for a registered id and ``PermissionDenied`` outside every root."""
        catalog = self.runtime.ready().adapters
        check_adapter_id(adapter_id, field=id_field)
        if not source:
            raise InvalidRequest(
                f"{source_field} is empty: give the adapter folder's path on the server, or hf://org/name",
                field=source_field,
            )
        if not catalog.roots:
            raise PermissionDenied(
                "this server loads adapters from no folder: start it with --adapter-root DIR (or --adapter-dir DIR)"
            )
        parsed = parse_source(source)
        # Registration reads a config file and safetensors headers (and an hf:// ref): file I/O, off the event loop.
        await asyncio.to_thread(catalog.register, adapter_id, parsed)
        return catalog

    def unload(self, adapter_id: str, describe: Callable[[AdapterCatalog, str], T], *, id_field: str = "id") -> T:
        """Remove ``adapter_id``; ``describe(catalog, id)`` is its last view, taken before (and raising
        ``AdapterNotFound`` for an id not registered). The catalog refuses, changing nothing, while requests use it."""
        catalog = self.runtime.ready().adapters
        check_adapter_id(adapter_id, field=id_field)
        last = describe(catalog, adapter_id)
        catalog.unregister(adapter_id)
        return last
