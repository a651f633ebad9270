"""Adapter files are checked when they are read: finite values, unchanged since registration (else indexed again),
inside the allowed roots at read time, and a failed adapter is retried once its file changed, without an unload.
Real files written by peft / ``write_medusa``; the store's state is asserted after each step."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.adapter_files import edit_adapter_config, rewrite_adapter_tensors

from service import metrics
from service.adapters.common.files import NonFiniteTensor
from service.adapters.lora import store as store_mod
from service.adapters.lora.store import AdapterStore
from service.adapters.medusa import registry as medusa_registry
from service.adapters.medusa.format import write_medusa
from service.adapters.medusa.registry import MedusaRegistry
from service.errors import HeaderError, InvalidAdapter, PermissionDenied
from service.model.config import ModelConfig

CPU = torch.device("cpu")
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def written(tiny_peft_adapters: Callable[..., dict[str, Path]]) -> dict[str, Path]:
    """A healthy r=4 adapter and an r=8 one (same targets), to copy and break per test."""
    qv = ("q_proj", "v_proj")
    return tiny_peft_adapters(
        r4={"r": 4, "target_modules": qv, "seed": 1}, r8={"r": 8, "target_modules": qv, "seed": 2}
    )


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _registered_copy(make_store: Callable[..., AdapterStore], src: Path, folder: Path) -> AdapterStore:
    """A fresh store with a copy of the adapter ``src`` at ``folder`` registered as ``folder.name``."""
    store = make_store()
    store.register(folder.name, _copy(src, folder))
    return store


def _read_rank(store: AdapterStore, adapter_id: str) -> int:
    """The rank the store reports for ``adapter_id``, checked against the q_proj A it laid out for layer 0."""
    lora = store.layer(adapter_id, 0)
    assert lora is not None
    assert lora.modules["q_proj"].a.shape[0] == store.get(adapter_id).rank
    return store.get(adapter_id).rank


def _poison(value: float) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = sorted(k for k in tensors if "layers.1" in k and "v_proj.lora_B" in k)[0]
        return {k: torch.full_like(v, value) if k == key else v for k, v in tensors.items()}

    return edit


def _validate_count() -> float:
    for family in metrics.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == "loraplex_adapter_load_duration_seconds_count" and sample.labels == {
                "stage": "validate",
                "tier": "disk",
            }:
                return sample.value
    return 0.0


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_lora_tensor_is_refused_by_name(
    make_store: Callable[..., AdapterStore], written: dict[str, Path], tmp_path: Path, value: float
) -> None:
    folder = _copy(written["r4"], tmp_path / "bad")
    rewrite_adapter_tensors(folder, _poison(value))
    store = make_store()
    store.register("bad", folder)  # the header is fine: registration cannot know
    store.register("good", written["r4"])
    assert store.get("bad").state == "registered"
    before = _validate_count()
    with pytest.raises(NonFiniteTensor, match="non-finite") as info:
        store.ensure("bad", timeout=30)
    assert isinstance(info.value, InvalidAdapter) and info.value.status == "INVALID_ARGUMENT"
    assert info.value.tensor is not None and "layers.1" in info.value.tensor and "v_proj.lora_B" in info.value.tensor
    assert info.value.file == str((folder / WEIGHTS).resolve())
    assert store.get("bad").state == "failed" and store.state().device_lru == ()
    assert _validate_count() > before  # the check's cost is in the load-stage metrics
    store.ensure("good", timeout=30)
    assert store.state().device_lru == ("good",) and store.get("good").state == "device"


def test_a_file_replaced_after_registration_is_indexed_again(
    make_store: Callable[..., AdapterStore], written: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "swap"
    store = _registered_copy(make_store, written["r4"], folder)
    shutil.copy(written["r8"] / WEIGHTS, folder / WEIGHTS)  # larger, other shapes; the config still says r=4
    with pytest.raises(InvalidAdapter, match="rank") as info:
        store.ensure("swap", timeout=30)
    assert info.value.file == str((folder / WEIGHTS).resolve())
    assert store.get("swap").state == "failed"

    # Consistent new version (config and file): the next request retries, re-indexes and loads it, no unload.
    shutil.copy(written["r8"] / "adapter_config.json", folder / "adapter_config.json")
    os.utime(folder / WEIGHTS)  # the weights file changed again (a new version is deployed)
    first = store.get("swap").registered_at
    time.sleep(store_mod.RETRY_CHECK_SECONDS)
    store.ensure("swap", timeout=30)
    info2 = store.get("swap")
    assert info2.state == "device" and info2.rank == 8 and info2.registered_at > first
    assert _read_rank(store, "swap") == 8


def test_a_consistent_new_version_before_the_first_read_is_loaded_as_it_is_now(
    make_store: Callable[..., AdapterStore], written: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "v"
    store = _registered_copy(make_store, written["r4"], folder)
    assert store.get("v").rank == 4
    shutil.copy(written["r8"] / WEIGHTS, folder / WEIGHTS)
    shutil.copy(written["r8"] / "adapter_config.json", folder / "adapter_config.json")
    store.ensure("v", timeout=30)  # changed before its first read: indexed again, then loaded
    assert _read_rank(store, "v") == 8


def test_a_symlink_swapped_in_after_registration_cannot_escape_the_root(
    make_store: Callable[..., AdapterStore], written: dict[str, Path], tmp_path: Path
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    folder = _copy(written["r4"], root / "a")
    _copy(written["r4"], outside)
    store = make_store(roots=[root])
    store.register("a", folder)
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).symlink_to(outside / WEIGHTS)  # the same bytes, but outside the root
    with pytest.raises(PermissionDenied):
        store.ensure("a", timeout=30)
    assert store.get("a").state == "failed" and store.state().device_lru == ()


def test_a_folder_swapped_for_a_symlink_is_caught_on_the_opened_file(
    make_store: Callable[..., AdapterStore], written: dict[str, Path], tmp_path: Path
) -> None:
    """The weights file outside is a hard link to the very inode registered (same stamp): only the opened
    descriptor's real path shows that the read would leave the root."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    folder = _copy(written["r4"], root / "a")
    store = make_store(roots=[root])
    store.register("a", folder)
    os.link(folder / WEIGHTS, outside / WEIGHTS)
    shutil.copy(folder / "adapter_config.json", outside / "adapter_config.json")
    shutil.rmtree(folder)
    folder.symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionDenied, match="outside the allowed adapter roots"):
        store.ensure("a", timeout=30)
    assert store.get("a").state == "failed" and store.state().device_lru == ()


def test_a_truncated_file_once_fixed_is_retried_without_an_unload(
    make_store: Callable[..., AdapterStore], written: dict[str, Path], tmp_path: Path
) -> None:
    folder = _copy(written["r4"], tmp_path / "t")
    file = folder / WEIGHTS
    store = make_store()
    store.register("t", folder)
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 64)
    with pytest.raises(HeaderError, match="truncated"):
        store.ensure("t", timeout=30)
    assert store.get("t").state == "failed"
    time.sleep(store_mod.RETRY_CHECK_SECONDS)
    assert store.request("t") is False and store.get("t").state == "failed"  # unchanged: no retry storm
    assert store.state().queued == ()
    shutil.copy(written["r4"] / WEIGHTS, file)
    time.sleep(store_mod.RETRY_CHECK_SECONDS)
    store.ensure("t", timeout=30)
    assert store.get("t").state == "device" and store.failure("t") is None


def test_non_finite_and_changed_medusa_heads(tiny_cfg: ModelConfig, tmp_path: Path) -> None:
    h = tiny_cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(1, 2, h, h, generator=g) / h**0.5, torch.zeros(1, 2, h)
    registry = MedusaRegistry(tiny_cfg, device=CPU, dtype=torch.float32)
    try:
        bad = weight.clone()
        bad[0, 1, 3, 5] = float("nan")
        folder = write_medusa(tmp_path / "nan", bad, bias, version=2)
        registry.register("nan", folder)
        before = _validate_count()
        assert _wait(registry, "nan") is False
        assert _validate_count() == before + 1  # the check's cost is in the load-stage metrics
        error = registry.failure("nan")
        assert isinstance(error, NonFiniteTensor) and error.tensor == "1.0.linear.weight"
        assert error.file == str((folder / "medusa_lm_head.safetensors").resolve())
        # Fixed on disk: the next request retries it without an unload.
        write_medusa(folder, weight, bias, version=2)
        time.sleep(medusa_registry.RETRY_CHECK_SECONDS)
        assert _wait(registry, "nan") is True and registry.failure("nan") is None

        # Replaced after registration by heads of another count: indexed again, then loaded as they are now.
        other = write_medusa(tmp_path / "swap", weight, bias, version=2)
        registry.register("swap", other)
        write_medusa(other, torch.cat([weight, weight], 1), torch.cat([bias, bias], 1), version=2)
        assert _wait(registry, "swap") is True and registry.heads("swap").num_heads == 4
    finally:
        registry.close()


def _wait(registry: MedusaRegistry, adapter_id: str) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if registry.request(adapter_id):
            return True
        if registry.failure(adapter_id) is not None:
            return False
        time.sleep(0.01)
    raise AssertionError(f"{adapter_id} neither loaded nor failed")


def test_config_edit_alone_does_not_count_as_a_weights_change(
    make_store: Callable[..., AdapterStore], written: dict[str, Path], tmp_path: Path
) -> None:
    folder = _copy(written["r4"], tmp_path / "c")
    rewrite_adapter_tensors(folder, _poison(float("nan")))
    store = make_store()
    store.register("c", folder)
    with pytest.raises(NonFiniteTensor):
        store.ensure("c", timeout=30)
    edit_adapter_config(folder, lora_alpha=4)
    time.sleep(store_mod.RETRY_CHECK_SECONDS)
    assert store.request("c") is False and store.get("c").state == "failed"


def test_an_adapter_too_large_for_the_budget_is_retried_once_its_files_change(
    tiny_cfg: ModelConfig, written: dict[str, Path], tmp_path: Path
) -> None:
    from service.adapters.lora.reader import DEVICE_ALIGN
    from service.adapters.lora.registry import index_adapter, plan_nbytes
    from service.errors import ResourceExhausted

    folder = _copy(written["r8"], tmp_path / "big")
    small = plan_nbytes(index_adapter("s", written["r4"], tiny_cfg), torch.float32, DEVICE_ALIGN)
    store = AdapterStore(tiny_cfg, device=CPU, dtype=torch.float32, device_budget_bytes=small, host_budget_bytes=0)
    try:
        store.register("big", folder)
        assert store.request("big") is False
        assert isinstance(store.failure("big"), ResourceExhausted) and store.get("big").state == "failed"
        shutil.copy(written["r4"] / WEIGHTS, folder / WEIGHTS)  # a smaller version is deployed
        shutil.copy(written["r4"] / "adapter_config.json", folder / "adapter_config.json")
        time.sleep(store_mod.RETRY_CHECK_SECONDS)
        store.ensure("big", timeout=30)
        assert store.get("big").state == "device" and store.get("big").rank == 4
    finally:
        store.close()
