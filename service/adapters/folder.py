"""What every adapter folder format shares (PEFT LoRA, Medusa): the folder checks and its JSON config.

``check_folder`` and ``refuse_pickles`` run before any file is parsed; ``read_json_object`` returns the config as
one JSON object. Every problem is an ``InvalidAdapter`` naming the file (``NotFound`` for a missing folder); nothing
here knows either format's fields.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.errors import InvalidAdapter, NotFound, shorten


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


__all__ = ["check_folder", "is_int", "read_json_object", "refuse_pickles", "short_repr"]
