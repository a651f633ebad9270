"""``with`` for anything that has ``close()``: leaving the block closes it (the client and its streams).

The mixin only forwards; what closing means (cancel a stream's RPC, close an owned channel) is each class's own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class Closing(ABC):
    """``with obj:`` returns ``obj`` and calls ``obj.close()`` on the way out, exception or not."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
