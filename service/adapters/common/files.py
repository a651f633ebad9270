"""Adapter files, checked the same way for every adapter kind: the path policy, the folder, its JSON config, and
every later read.

Path policy: with ``roots`` given, a folder *and* the files read from it are resolved (symlinks followed) and must
lie inside one root (``resolve_source``); anything else is ``PermissionDenied``. ``check_folder`` and
``refuse_pickles`` run before any file is parsed; ``read_json_object`` returns a config as one JSON object. Nothing
here knows any kind's fields.

Registration indexes a file's header and records its identity (``FileStamp``: size, mtime_ns, inode, device).
Every later read opens the file through ``open_verified``, which refuses to follow a symlink at the last path
component (``O_NOFOLLOW``), checks the opened descriptor's real path against the allowed roots, and compares the
descriptor's ``fstat`` with the stamp, so the offsets from the index are only ever applied to the bytes they were
computed from. Any difference raises ``AdapterFileChanged``: the caller re-validates the file like a new
registration. Tensors read from an adapter file go through ``check_finite``: one NaN or inf in a weight would
reach every token of the requests that use it, so such a tensor is refused by name before it is served.
Every problem is an ``InvalidAdapter`` naming the file (``NotFound`` for a missing folder).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from service.errors import InvalidAdapter, NotFound, PermissionDenied, shorten


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


def resolve_source(path: Path, roots: Sequence[Path]) -> Path:
    """The adapter folder (or file) with symlinks resolved; with ``roots``, it must lie inside one of them."""
    resolved = Path(path).expanduser().resolve()
    if roots and not _inside(resolved, roots):
        raise PermissionDenied(
            f"adapter path {shorten(path)!r} resolves outside the allowed adapter roots (--adapter-root); "
            "symlinks and '..' are resolved before the check"
        )
    return resolved


def check_folder(folder: Path, shown: Path) -> None:
    """``NotFound`` unless ``folder`` exists, ``InvalidAdapter`` unless it is a folder (both name ``shown``)."""
    if not folder.exists():
        raise NotFound(f"adapter folder {shorten(shown)!r} does not exist")
    if not folder.is_dir():
        raise InvalidAdapter("the adapter source is not a folder", file=shown)


def refuse_pickles(folder: Path, names: Sequence[str], what: str, hint: str) -> None:
    """``InvalidAdapter`` naming the first of ``names`` present in ``folder``: pickled files are never loaded."""
    pickles = [name for name in names if (folder / name).is_file()]
    if pickles:
        raise InvalidAdapter(f"pickled {what} are refused. {hint}", file=folder / pickles[0])


def read_json_object(path: Path, missing: str) -> dict[str, Any]:
    """The JSON object in ``path``; ``missing`` is the message when the file does not exist. Only a regular file is
    read: a FIFO or device file would block the reader or never end."""
    if Path(path).exists() and not Path(path).is_file():
        raise InvalidAdapter("not a regular file", file=path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidAdapter(missing, file=path) from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 / JSON, a number past int()'s limit
        raise InvalidAdapter(f"cannot read JSON: {e}", file=path) from None
    if not isinstance(raw, dict):
        raise InvalidAdapter("expected a JSON object", file=path)
    return raw


def is_int(value: Any) -> bool:
    """An integer that is not a bool (JSON ``true`` parses as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)``, cut to ``limit`` characters (a config value can be any size)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    "check_folder",
    "is_int",
    "open_verified",
    "read_json_object",
    "refuse_pickles",
    "resolve_source",
    "short_repr",
    "stamp",
    "stamp_or_none",
]
