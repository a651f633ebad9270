"""The server-wide drafters (``--draft``), one line each in ``SERVER_DRAFTERS``; an adapter's own drafter (its
Medusa heads) comes with the adapter instead. The server's drafter serves greedy rows whose adapter brings none.
"""

from __future__ import annotations

from collections.abc import Callable

from service.drafters.base import Drafter, DraftSettings
from service.drafters.prompt_lookup import PromptLookupDrafter

SERVER_DRAFTERS: dict[str, Callable[[DraftSettings], Drafter]] = {
    "prompt-lookup": PromptLookupDrafter.from_settings,
}


def server_drafter(settings: DraftSettings) -> Drafter | None:
    """The drafter ``settings.draft`` names, or None for ``"none"``."""
    if settings.draft == "none":
        return None
    return SERVER_DRAFTERS[settings.draft](settings)


__all__ = ["SERVER_DRAFTERS", "server_drafter"]
