"""The compiled kernels for the tests that prove them (``compiled_kernels``), and the process's native-kernel choice
for the length of a ``with`` (``kernels_mode``): the tests that prove a path on the compiled kernels and on torch's
eager ones load one model of each."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from service.kernels import native


@contextmanager
def kernels_mode(mode: str, cache_dir: Path | None = None) -> Iterator[None]:
    """``native.configure(mode, cache_dir)`` inside, the default (``auto``, the default cache) after."""
    native.configure(mode, cache_dir)
    try:
        yield
    finally:
        native.configure()


def compiled_kernels() -> native.NativeKernels:
    """The loaded kernels. Skips only where there is no C++ compiler (the eager paths are then the whole story); a
    machine with one whose build or load failed fails the test, so the compiled paths never go unproved quietly."""
    k = native.kernels()
    if k is not None:
        return k
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip(f"no native kernels here: {native.status()}")
    pytest.fail(f"a C++ compiler is here but the native kernels did not load: {native.status()}")
