"""The process's native-kernel choice (``service.kernels.native``) for the length of a ``with``: the tests that prove
a path on the compiled kernels and on torch's eager ones load one model of each."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service.kernels import native


@contextmanager
def kernels_mode(mode: str, cache_dir: Path | None = None) -> Iterator[None]:
    """``native.configure(mode, cache_dir)`` inside, the default (``auto``, the default cache) after."""
    native.configure(mode, cache_dir)
    try:
        yield
    finally:
        native.configure()
