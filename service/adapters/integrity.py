"""Adapter files checked when they are read, not only when they were registered.

Registration indexes a file's header and records its identity (``FileStamp``: size, mtime_ns, inode, device).
Every later read opens the file through ``open_verified``, which refuses to follow a symlink at the last path
component (``O_NOFOLLOW``), checks the opened descriptor's real path against the allowed roots, and compares the
descriptor's ``fstat`` with the stamp, so the offsets from the index are only ever applied to the bytes they were
computed from. Any difference raises ``AdapterFileChanged``: the caller re-validates the file like a new
registration. Tensors read from an adapter file go through ``check_finite``: one NaN or inf in a weight would
reach every token of the requests that use it, so such a tensor is refused by name before it is served.

Public API::

    FileStamp.of(stat_result) / stamp(path) -> FileStamp / stamp_or_none(path) -> FileStamp | None
    open_verified(path, stamp, roots, *, check_path=None) -> int   read-only fd; AdapterFileChanged / PermissionDenied
    check_finite(tensor, name, file) -> None       NonFiniteTensor
    AdapterFileChanged, NonFiniteTensor            (InvalidAdapter subclasses: INVALID_ARGUMENT)
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from service.errors import InvalidAdapter, PermissionDenied, shorten


class AdapterFileChanged(InvalidAdapter):
    """The file on disk is no longer the one indexed at registration (replaced, rewritten, swapped for a link)."""


class NonFiniteTensor(InvalidAdapter):
    """An adapter tensor holds NaN or inf."""


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What identifies one version of a file: a rewrite changes mtime_ns (or size), a replacement the inode."""

    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def describe_change(self, now: FileStamp) -> str:
        if (now.inode, now.device) != (self.inode, self.device):
            return "the file was replaced"
        if now.size != self.size:
            return f"its size changed from {self.size} to {now.size} bytes"
        return "it was rewritten (its modification time changed)"


def stamp(path: Path) -> FileStamp:
    """The stamp of ``path`` now (symlinks followed; registration resolves paths first)."""
    return FileStamp.of(os.stat(path))


def stamp_or_none(path: Path) -> FileStamp | None:
    """``stamp(path)``, or None when the file cannot be stat()ed (missing, unreadable folder)."""
    try:
        return stamp(path)
    except OSError:
        return None


def _inside(real: Path, roots: Sequence[Path]) -> bool:
    return any(real.is_relative_to(Path(r).expanduser().resolve()) for r in roots)


def _fd_path(fd: int, fallback: Path) -> Path:
    """The real path of an open descriptor (Linux ``/proc``); elsewhere the resolved path it was opened by."""
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return fallback.resolve()


def open_verified(
    path: Path,
    expected: FileStamp | None,
    roots: Sequence[Path],
    *,
    check_path: Callable[[Path], object] | None = None,
) -> int:
    """Open ``path`` read-only without following a final symlink; check where it really is and that it is
    unchanged since ``expected`` was taken. Raises ``AdapterFileChanged`` (re-validate it), ``PermissionDenied``
    (it now lies outside ``roots``, or ``check_path(real path)`` refused it), or ``OSError`` (gone, unreadable)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise AdapterFileChanged("the file was replaced by a symlink after registration", file=path) from None
        raise
    try:
        if check_path is not None:
            check_path(_fd_path(fd, path))
        if roots:
            real = _fd_path(fd, path)
            if not _inside(real, roots):
                raise PermissionDenied(
                    f"adapter file {shorten(path)!r} now resolves to {shorten(real)!r}, outside the allowed adapter "
                    "roots (--adapter-root)"
                )
        if expected is not None:
            now = FileStamp.of(os.fstat(fd))
            if now != expected:
                raise AdapterFileChanged(
                    f"changed since registration ({expected.describe_change(now)}); it is re-validated", file=path
                )
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_finite(tensor: torch.Tensor, name: str, file: Path | str) -> None:
    """Refuse a tensor holding NaN or inf, naming the file, the tensor and how many such values it has."""
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    nan = int(torch.isnan(tensor).sum())
    inf = int(tensor.numel() - int(finite.sum()) - nan)
    raise NonFiniteTensor(
        f"holds non-finite values ({nan} NaN, {inf} inf of {tensor.numel()}); the adapter cannot be served",
        file=file,
        tensor=name,
    )


__all__ = [
    "AdapterFileChanged",
    "FileStamp",
    "NonFiniteTensor",
    "check_finite",
    "open_verified",
    "stamp",
    "stamp_or_none",
]
