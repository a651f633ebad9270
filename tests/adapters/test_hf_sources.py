"""Adapters from a Hugging Face cache: ``hf://org/name[@revision]``, resolved on disk, inside the allowed roots.

The cache is built in tmp_path in the layout ``huggingface_hub`` writes: ``models--org--name/refs/<ref>`` holding a
commit hash, ``snapshots/<commit>/<file>`` relative symlinks into ``blobs/<sha256>``. The adapter files in it are
real (PEFT-written LoRA, Medusa heads) and are served over real gRPC.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from loraplex import Client, InvalidArgument, NotFound, PermissionDenied
from support.adapter_files import write_peft_adapter

from service import metrics
from service.adapters.common.files import open_verified
from service.adapters.lora.registry import index_adapter
from service.adapters.medusa.format import write_medusa
from service.api.server import BackgroundServer
from service.cli import build_parser, serve_settings
from service.config import ConfigError, Settings
from service.errors import InvalidAdapter, InvalidRequest
from service.errors import NotFound as NotFoundError
from service.errors import PermissionDenied as PermissionDeniedError
from service.hf_cache import DEFAULT_HUB_CACHE, HubRef, hub_cache_dir, parse_source, resolve_hub
from service.model.config import ModelConfig

COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"
PROMPT = "The adapter says"


def add_snapshot(cache: Path, repo_id: str, commit: str, files: Path, refs: tuple[str, ...] = ()) -> Path:
    """Put the files of folder ``files`` into ``cache`` as commit ``commit`` of ``repo_id`` (blobs + symlinks), and
    point each ref in ``refs`` at it. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes the hash with no newline
    return snapshot


@pytest.fixture(scope="module")
def hub(served_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A cache with acme/caps (main: a LoRA; ref ``heads`` and commit B: Medusa heads), acme/boot (a LoRA), and
    acme/other (a LoRA that the test server's roots leave out); plain copies of the same files for reference."""
    base = tmp_path_factory.mktemp("hub_sources")
    cache, plain = base / "hub", base / "plain"
    cfg = ModelConfig.from_hf(served_tiny_dir)
    write_peft_adapter(plain / "caps", served_tiny_dir, r=4, alpha=8, seed=21, scale=0.5)
    write_peft_adapter(plain / "boot", served_tiny_dir, r=4, alpha=8, seed=22, scale=0.5)
    g = torch.Generator().manual_seed(3)
    h = cfg.hidden_size
    write_medusa(plain / "heads", torch.randn(1, 3, h, h, generator=g) * 0.05, torch.zeros(1, 3, h), version=2)
    add_snapshot(cache, "acme/caps", COMMIT_A, plain / "caps", refs=("main",))
    add_snapshot(cache, "acme/caps", COMMIT_B, plain / "heads", refs=("heads", "pr/1"))
    add_snapshot(cache, "acme/boot", COMMIT_A, plain / "boot", refs=("main",))
    add_snapshot(cache, "acme/other", COMMIT_A, plain / "caps", refs=("main",))
    # a snapshot whose weights symlink leads out of the cache
    evil = cache / "models--acme--caps" / "snapshots" / ("e" * 40)
    evil.mkdir()
    shutil.copy(plain / "caps" / "adapter_config.json", evil / "adapter_config.json")
    (base / "outside").mkdir()
    shutil.copy(plain / "caps" / "adapter_model.safetensors", base / "outside" / "weights.safetensors")
    (evil / "adapter_model.safetensors").symlink_to(base / "outside" / "weights.safetensors")
    return {"cache": cache, "plain": plain, "outside": base / "outside"}


# --- parsing and the cache folder ----------------------------------------------------------------------


def test_parse_source() -> None:
    assert parse_source("/srv/adapters/caps") == Path("/srv/adapters/caps")
    assert parse_source("hf://acme/caps") == HubRef("acme/caps", "main")
    assert parse_source("hf://acme/caps@v1.0") == HubRef("acme/caps", "v1.0")
    assert parse_source(f"hf://acme/caps@{COMMIT_B}") == HubRef("acme/caps", COMMIT_B)
    assert parse_source("hf://gpt2@pr/1") == HubRef("gpt2", "pr/1")
    assert str(HubRef("acme/caps", "v2")) == "hf://acme/caps@v2" and str(HubRef("acme/caps")) == "hf://acme/caps"
    for bad in ("hf://", "hf://acme/caps/extra", "hf://../caps", "hf://acme/..", "hf://acme--x/caps",
                "hf://acme/caps@", "hf://acme/caps@../../x", "hf://acme/caps@a//b", "hf://ac me/caps"):  # fmt: skip
        with pytest.raises(InvalidRequest):
            parse_source(bad)


def test_hub_cache_dir_follows_huggingface_hub_variables(tmp_path: Path) -> None:
    assert hub_cache_dir({}) == DEFAULT_HUB_CACHE
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}) == Path("/h/hub")
    assert hub_cache_dir({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}) == Path("/c")
    assert Settings.from_env({"HF_HOME": "/h"}).hf_hub_cache == Path("/h/hub")
    assert Settings.from_env({"HF_HOME": "/h", "LORAPLEX_HF_HUB_CACHE": "/mine"}).hf_hub_cache == Path("/mine")
    args = build_parser().parse_args(["serve", "--hf-hub-cache", "/flag", "--adapter", "x=hf://acme/caps@v2"])
    settings = serve_settings(args, {"HF_HUB_CACHE": "/c"})
    assert settings.hf_hub_cache == Path("/flag") and settings.adapters == (("x", HubRef("acme/caps", "v2")),)
    assert Settings.from_env({"LORAPLEX_ADAPTERS": "a=hf://acme/caps,b=/p"}).adapters == (
        ("a", HubRef("acme/caps")), ("b", Path("/p")),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="invalid Hugging Face reference"):
        Settings.from_env({"LORAPLEX_ADAPTERS": "a=hf://acme/../x"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--adapter", "x=hf://acme/caps@.."])


def test_resolve_by_ref_commit_and_the_missing_cases(hub: dict[str, Path]) -> None:
    cache = hub["cache"]
    snapshots = cache / "models--acme--caps" / "snapshots"
    assert resolve_hub(HubRef("acme/caps"), cache) == snapshots / COMMIT_A
    assert resolve_hub(HubRef("acme/caps", "heads"), cache) == snapshots / COMMIT_B
    assert resolve_hub(HubRef("acme/caps", "pr/1"), cache) == snapshots / COMMIT_B
    assert resolve_hub(HubRef("acme/caps", COMMIT_B), cache) == snapshots / COMMIT_B
    with pytest.raises(NotFoundError) as absent_repo:
        resolve_hub(HubRef("acme/nope"), cache)
    assert str(cache / "models--acme--nope") in str(absent_repo.value)
    with pytest.raises(NotFoundError) as absent_rev:
        resolve_hub(HubRef("acme/caps", "v9"), cache)
    assert str(cache / "models--acme--caps" / "refs" / "v9") in str(absent_rev.value)
    assert str(snapshots / "v9") in str(absent_rev.value)


def test_a_ref_to_a_missing_snapshot_or_not_a_hash(hub: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    add_snapshot(cache, "acme/x", COMMIT_A, hub["plain"] / "caps", refs=("main",))
    refs = cache / "models--acme--x" / "refs"
    (refs / "gone").write_text("f" * 40)
    with pytest.raises(NotFoundError, match=r"names commit f{40}, but .* does not exist"):
        resolve_hub(HubRef("acme/x", "gone"), cache)
    (refs / "odd").write_text("../../../etc")
    with pytest.raises(InvalidAdapter, match="40-digit commit hash"):
        resolve_hub(HubRef("acme/x", "odd"), cache)


def test_blob_symlinks_pass_the_integrity_checks_inside_the_cache(hub: dict[str, Path], served_tiny_dir: Path) -> None:
    cache = hub["cache"]
    cfg = ModelConfig.from_hf(served_tiny_dir)
    spec = index_adapter("caps", resolve_hub(HubRef("acme/caps"), cache), cfg, roots=(cache,))
    assert spec.file.parent.name == "blobs"  # the symlink was resolved at registration
    os.close(open_verified(spec.file, spec.stamp, (cache,)))  # O_NOFOLLOW on the blob itself: accepted
    with pytest.raises(PermissionDeniedError, match="outside the allowed adapter roots"):
        index_adapter("evil", cache / "models--acme--caps" / "snapshots" / ("e" * 40), cfg, roots=(cache,))


# --- served --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_settings(hub: dict[str, Path]) -> dict[str, object]:
    """Roots: acme/caps's repo folder and the plain copies. acme/boot is an --adapter (its repo folder becomes a
    root of its own); acme/other is in the cache but in no root."""
    cache = hub["cache"]
    return {
        "hf_hub_cache": cache,
        "adapters": (("boot", HubRef("acme/boot")),),
        "adapter_roots": (cache / "models--acme--caps", hub["plain"]),
        "speculate_adaptive": False,
    }


def tokens(client: Client, adapter: str | None) -> list[int]:
    g = client.generate(PROMPT, adapter=adapter, max_new_tokens=16, ignore_eos=True, return_token_ids=True)
    return list(g.token_ids)


def test_hf_sources_serve_the_same_as_their_folders(server: BackgroundServer, hub: dict[str, Path]) -> None:
    plain = hub["plain"]
    with Client(server.target, timeout=120) as client:
        assert client.load_adapter("caps-hf", "hf://acme/caps").kind.value == "lora"
        assert client.load_adapter("caps-commit", f"hf://acme/caps@{COMMIT_A}").kind.value == "lora"
        assert client.load_adapter("heads-ref", "hf://acme/caps@heads").kind.value == "medusa"
        client.load_adapter("caps-dir", plain / "caps")
        client.load_adapter("boot-dir", plain / "boot")
        base = tokens(client, None)
        want = tokens(client, "caps-dir")
        assert want != base  # the LoRA changes the output, so equality below means it was applied
        assert tokens(client, "caps-hf") == want and tokens(client, "caps-commit") == want
        assert tokens(client, "boot") == tokens(client, "boot-dir") != base  # the start-up hf:// adapter
        drafted = metrics.SPECULATIVE_DRAFTED._value.get()
        got = client.generate(PROMPT, adapter="heads-ref", speculate=True, max_new_tokens=16, ignore_eos=True,
                              return_token_ids=True)  # fmt: skip
        assert list(got.token_ids) == base and metrics.SPECULATIVE_DRAFTED._value.get() > drafted
        # The source as given, the snapshot it resolved to apart, in GetAdapter, ListAdapters and UnloadAdapter.
        snapshot = str(hub["cache"] / "models--acme--caps" / "snapshots" / COMMIT_A)
        caps = client.get_adapter("caps-hf")
        assert (caps.source, caps.resolved_path) == ("hf://acme/caps", snapshot)
        listed = {a.id: (a.source, a.resolved_path) for a in client.list_adapters()}
        assert listed["caps-commit"] == (f"hf://acme/caps@{COMMIT_A}", snapshot)
        assert listed["heads-ref"][0] == "hf://acme/caps@heads"  # Medusa heads only
        assert listed["heads-ref"][1].startswith(str(hub["cache"] / "models--acme--caps" / "snapshots"))
        assert listed["caps-dir"] == (str(plain / "caps"), str(plain / "caps"))
        assert listed["boot"][0] == "hf://acme/boot"  # --adapter boot=hf://acme/boot at start-up
        removed = client.unload_adapter("caps-commit")
        assert (removed.source, removed.resolved_path) == (f"hf://acme/caps@{COMMIT_A}", snapshot)
        assert "caps-commit" not in {a.id for a in client.list_adapters()}


def test_missing_and_refused_hf_sources(server: BackgroundServer, hub: dict[str, Path]) -> None:
    cache = hub["cache"]
    with Client(server.target, timeout=60) as client:
        with pytest.raises(NotFound) as absent_repo:
            client.load_adapter("x1", "hf://acme/nope")
        assert str(cache / "models--acme--nope") in str(absent_repo.value)
        with pytest.raises(NotFound) as absent_rev:
            client.load_adapter("x2", "hf://acme/caps@v9")
        assert str(cache / "models--acme--caps" / "refs" / "v9") in str(absent_rev.value)
        with pytest.raises(PermissionDenied, match="outside the allowed adapter roots"):
            client.load_adapter("x3", "hf://acme/other")  # in the cache, but no root allows it
        with pytest.raises(PermissionDenied, match="outside the allowed adapter roots"):
            client.load_adapter("x4", f"hf://acme/caps@{'e' * 40}")  # inside a root, its weights symlink escapes
        with pytest.raises(InvalidArgument, match="invalid Hugging Face reference"):
            client.load_adapter("x5", "hf://acme/../../etc")
        ids = {a.id for a in client.list_adapters()}
    assert not ids & {"x1", "x2", "x3", "x4", "x5"}


def test_config_files_that_escape_or_never_end_are_refused_unread(
    server: BackgroundServer, hub: dict[str, Path]
) -> None:
    """A config.json symlinked out of the roots is refused before it is opened, and a config that is not a regular
    file is never read: both are FIFOs here, so reading either would block the call until its deadline."""
    cache, outside = hub["cache"], hub["outside"]
    fifo = outside / "config.fifo"
    os.mkfifo(fifo)
    escape = cache / "models--acme--caps" / "snapshots" / ("c" * 40)
    escape.mkdir()
    (escape / "config.json").symlink_to(fifo)
    inside = hub["plain"] / "fifo-config"
    inside.mkdir()
    os.mkfifo(inside / "adapter_config.json")
    try:
        with Client(server.target, timeout=30) as client:
            with pytest.raises(PermissionDenied, match="outside the allowed adapter roots"):
                client.load_adapter("fifo-escape", f"hf://acme/caps@{'c' * 40}")
            with pytest.raises(InvalidArgument, match="not a regular file"):
                client.load_adapter("fifo-inside", inside)
    finally:  # release a reader the code under test might have left blocked
        for path in (fifo, inside / "adapter_config.json"):
            with contextlib.suppress(OSError):  # ENXIO: nobody is reading it
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def test_cli_help_and_client_docs_name_hf_sources(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["adapters", "load", "--help"])
    assert "hf://org/name[@revision]" in " ".join(capsys.readouterr().out.split())
    assert "hf://org/name[@revision]" in (Client.load_adapter.__doc__ or "")
