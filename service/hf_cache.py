"""Where an adapter comes from: a folder path, or a Hugging Face cache reference ``hf://org/name[@revision]``.

A reference is resolved on disk only, in the layout ``huggingface_hub`` writes under its cache folder
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``)::

    models--org--name/refs/main                 the commit a ref names (a branch, a tag, ``pr/1``)
    models--org--name/snapshots/<commit>/...    the files of that commit: symlinks into blobs/
    models--org--name/blobs/<sha>               the bytes

Nothing here opens a network connection or writes: a repo or revision missing from the cache is ``NotFound``
naming the paths looked up. The result is an ordinary adapter folder, so the registry's path policy (the allowed
roots) and the integrity checks apply to it and to the blobs its symlinks resolve to, as to any folder; an
operator allows the cache with ``--adapter-root`` (the hub folder, or one ``models--org--name`` folder).
It imports no torch (the settings parse ``--adapter ID=hf://...`` with it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service.errors import InvalidAdapter, InvalidRequest, NotFound, shorten

__all__ = [
    "DEFAULT_HUB_CACHE",
    "SCHEME",
    "AdapterSource",
    "HubRef",
    "hub_cache_dir",
    "parse_source",
    "resolve_hub",
    "source_folder",
]

SCHEME = "hf://"
DEFAULT_HUB_CACHE = Path("~/.cache/huggingface/hub")
_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")  # one of org / name, as the Hub names them
_REVISION = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_MAX_REVISION = 255


@dataclass(frozen=True, slots=True)
class HubRef:
    """``hf://repo_id@revision``: a repo in the local Hugging Face cache and a ref name or commit hash."""

    repo_id: str  # "org/name" (or a legacy "name")
    revision: str = "main"

    def __str__(self) -> str:
        return f"{SCHEME}{self.repo_id}" + ("" if self.revision == "main" else f"@{self.revision}")

    def repo_folder(self, cache: Path) -> Path:
        """``cache/models--org--name``: the repo's refs, snapshots and blobs."""
        return Path(cache).expanduser() / ("models--" + self.repo_id.replace("/", "--"))


AdapterSource = Path | HubRef


def parse_source(text: str) -> AdapterSource:
    """``hf://org/name[@revision]`` as a ``HubRef`` (``InvalidRequest`` when malformed), anything else a path."""
    if not text.startswith(SCHEME):
        return Path(text)
    repo_id, _, revision = text[len(SCHEME) :].partition("@")
    parts = repo_id.split("/")
    if not 1 <= len(parts) <= 2 or not all(_PART.fullmatch(p) and "--" not in p and ".." not in p for p in parts):
        raise InvalidRequest(
            f"invalid Hugging Face reference {shorten(text)!r}: expected hf://org/name or hf://org/name@revision "
            "(names of letters, digits, '.', '_', '-')"
        )
    if "@" in text and not _good_revision(revision):
        raise InvalidRequest(
            f"invalid revision in {shorten(text)!r}: a ref name (main, v1.0, pr/1) or a 40-digit commit hash"
        )
    return HubRef(repo_id, revision or "main")


def _good_revision(revision: str) -> bool:
    return (
        0 < len(revision) <= _MAX_REVISION
        and _REVISION.fullmatch(revision) is not None
        and all(part not in (".", "..") for part in revision.split("/"))
    )


def hub_cache_dir(env: Mapping[str, str]) -> Path:
    """The hub cache ``huggingface_hub`` uses under ``env``: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "huggingface" / "hub"
    return DEFAULT_HUB_CACHE


def resolve_hub(ref: HubRef, cache: Path) -> Path:
    """The snapshot folder of ``ref`` in ``cache``: ``refs/<revision>`` names a commit, or the revision is one.
    ``NotFound`` naming what was looked up when the repo or the revision is not in the cache."""
    repo = ref.repo_folder(cache)
    if not repo.is_dir():
        raise NotFound(
            f"{ref}: {shorten(repo)} does not exist (the Hugging Face cache is {shorten(Path(cache).expanduser())}, "
            "from HF_HUB_CACHE / HF_HOME; loraplex never downloads: fetch it with `hf download` first)"
        )
    ref_file = repo / "refs" / ref.revision
    if ref_file.is_file():
        commit = _read_commit(ref_file)
        snapshot = repo / "snapshots" / commit
        if not snapshot.is_dir():
            raise NotFound(f"{ref}: refs/{ref.revision} names commit {commit}, but {shorten(snapshot)} does not exist")
        return snapshot
    snapshot = repo / "snapshots" / ref.revision
    if snapshot.is_dir():
        return snapshot
    raise NotFound(
        f"{ref}: revision {ref.revision!r} is not in the cache: neither {shorten(ref_file)} nor "
        f"{shorten(snapshot)} exists"
    )


def _read_commit(ref_file: Path) -> str:
    try:
        commit = ref_file.read_text(encoding="ascii").strip()
    except (OSError, ValueError) as e:
        raise InvalidAdapter(f"cannot read the ref: {e}", file=ref_file) from None
    if not _COMMIT.fullmatch(commit):
        raise InvalidAdapter(f"a ref file holds a 40-digit commit hash, not {shorten(commit, 60)!r}", file=ref_file)
    return commit


def source_folder(source: AdapterSource, cache: Path) -> Path:
    """The folder ``source`` names: a path as given, a ``HubRef`` resolved in ``cache``."""
    return resolve_hub(source, cache) if isinstance(source, HubRef) else Path(source)
