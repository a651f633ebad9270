"""The one wait helper: poll a condition until it holds or a timeout passes (callers assert on the result)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, poll: float = 0.0005) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(poll)
    return True
