"""What ``stream()`` returns: an iterator of ``Delta``s that is also a context manager (sync and asyncio).

Leaving the ``with`` block, breaking out of the loop and calling ``close()`` / ``aclose()`` all cancel the RPC
if it is still running (the server then frees the request's slot); a stream never iterated never sent its RPC.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from types import TracebackType
from typing import Self

from loraplex._closing import Closing
from loraplex._types import Delta


class DeltaStream(Closing, Iterator[Delta]):
    """``for delta in client.stream(...)``, or ``with client.stream(...) as deltas:``."""

    def __init__(self, deltas: Generator[Delta, None, None]) -> None:
        self._deltas = deltas

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Delta:
        return next(self._deltas)

    def close(self) -> None:
        """Cancel the RPC if it is running; further iteration ends at once."""
        self._deltas.close()


class AsyncDeltaStream(AsyncIterator[Delta]):
    """``async for delta in client.stream(...)``, or ``async with client.stream(...) as deltas:``."""

    def __init__(self, deltas: AsyncGenerator[Delta, None]) -> None:
        self._deltas = deltas

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Delta:
        return await self._deltas.__anext__()

    async def aclose(self) -> None:
        """Cancel the RPC if it is running; further iteration ends at once."""
        await self._deltas.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
