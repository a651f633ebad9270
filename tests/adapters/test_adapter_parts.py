"""The catalog over part kinds it has never heard of: ownership in table order, all-or-nothing registration,
removal in reverse order, and one merged per-request ``Adapter``. No model, no tensors: fake kinds only."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from pathlib import Path

import pytest

from service.adapters.catalog import AdapterCatalog
from service.adapters.common.part import Binding, PartUsage
from service.drafters.base import Drafter
from service.errors import AdapterNotFound, FailedPrecondition, InvalidAdapter, LoraplexError, PermissionDenied


class FakeClaim:
    def __init__(self, kind: FakeKind, adapter_id: str) -> None:
        self.kind, self.id, self.loaded = kind, adapter_id, False

    def load(self) -> None:
        self.loaded = True
        self.kind.log.append(f"load {self.kind.name}")

    def release(self) -> None:
        self.kind.log.append(f"release {self.kind.name}")

    def ready(self) -> bool:
        return self.loaded

    def failure(self) -> LoraplexError | None:
        return self.kind.error

    def kv_key(self) -> Hashable | None:
        return self.kind.key

    def drafts(self) -> bool:
        return self.kind.drafter is not None

    def binding(self) -> Binding:
        return Binding(deltas=self.kind.deltas, drafter=self.kind.drafter)


class FakeKind:
    """A kind whose folders hold ``{name}.json``."""

    def __init__(self, name: str, log: list[str], **behaviour: object) -> None:
        self.name, self.log = name, log
        self.markers: tuple[str, ...] = (f"{name}.json",)
        self.parts: set[str] = set()
        self.refuse_register = bool(behaviour.get("refuse_register", False))
        self.refuse_unregister = bool(behaviour.get("refuse_unregister", False))
        self.deltas = bool(behaviour.get("deltas", False))
        self.drafter: Drafter | None = behaviour.get("drafter")  # type: ignore[assignment]
        self.key: Hashable | None = behaviour.get("key")  # type: ignore[assignment]
        self.error: LoraplexError | None = behaviour.get("error")  # type: ignore[assignment]

    def owns(self, folder: Path) -> bool:
        return (folder / self.markers[0]).is_file()

    def register(self, adapter_id: str, folder: Path) -> None:
        self.log.append(f"register {self.name}")
        if self.refuse_register or not self.owns(folder):
            raise InvalidAdapter(f"no {self.markers[0]}", file=folder)
        self.parts.add(adapter_id)

    def unregister(self, adapter_id: str) -> None:
        self.log.append(f"unregister {self.name}")
        if self.refuse_unregister:
            raise FailedPrecondition("in use")
        self.parts.discard(adapter_id)

    def has(self, adapter_id: str) -> bool:
        return adapter_id in self.parts

    def ids(self) -> Iterable[str]:
        return sorted(self.parts)

    def prefetch(self, adapter_id: str) -> None:
        self.log.append(f"prefetch {self.name}")

    def claim(self, adapter_id: str) -> FakeClaim:
        return FakeClaim(self, adapter_id)

    def usage(self, adapter_id: str) -> PartUsage:
        return PartUsage(1, 0, True)

    def layer(self, adapter_id: str, layer: int) -> object | None:
        return f"{self.name}:{layer}" if self.deltas else None

    def close(self, timeout: float | None = None) -> None:
        self.log.append(f"close {self.name}")


def folder(tmp_path: Path, *markers: str) -> Path:
    out = tmp_path / "-".join(markers or ("empty",))
    out.mkdir()
    for m in markers:
        (out / f"{m}.json").write_text("{}")
    return out


def test_each_kind_is_asked_in_table_order_and_the_last_takes_what_no_kind_claims(tmp_path: Path) -> None:
    log: list[str] = []
    heads, weights = FakeKind("heads", log), FakeKind("weights", log)
    catalog = AdapterCatalog([heads, weights])
    catalog.register("both", folder(tmp_path, "heads", "weights"))
    catalog.register("one", folder(tmp_path, "heads"))
    assert log == ["register heads", "register weights", "register heads"]
    with pytest.raises(InvalidAdapter, match=r"no weights\.json"):  # the last kind names what is missing
        catalog.register("none", folder(tmp_path))
    assert catalog.ids() == ["both", "one"] and catalog.source_of("both") == str(tmp_path / "heads-weights")
    assert catalog.kind(FakeKind) is heads and catalog.kind(str) is None


def test_registration_is_all_or_nothing_and_removal_runs_in_reverse(tmp_path: Path) -> None:
    log: list[str] = []
    heads, weights = FakeKind("heads", log), FakeKind("weights", log, refuse_register=True)
    catalog = AdapterCatalog([heads, weights])
    with pytest.raises(InvalidAdapter):
        catalog.register("x", folder(tmp_path, "heads", "weights"))
    assert not heads.has("x") and log[-1] == "unregister heads"
    weights.refuse_register, weights.refuse_unregister = False, True
    catalog.register("x", tmp_path / "heads-weights")
    with pytest.raises(FailedPrecondition):  # the part that refuses is removed first: nothing is removed
        catalog.unregister("x")
    assert heads.has("x") and weights.has("x")
    weights.refuse_unregister = False
    log.clear()
    catalog.unregister("x")
    assert log == ["unregister weights", "unregister heads"] and catalog.ids() == []
    with pytest.raises(AdapterNotFound):
        catalog.resolve("x")


def test_the_path_policy_covers_every_kinds_markers(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "weights.json").write_text("{}")
    (root / "a").mkdir()
    (root / "a" / "weights.json").symlink_to(outside / "weights.json")
    catalog = AdapterCatalog([FakeKind("heads", []), FakeKind("weights", [])], roots=(root,))
    with pytest.raises(PermissionDenied, match="outside the allowed adapter roots"):
        catalog.register("a", root / "a")


def test_one_adapter_merges_its_parts_claims(tmp_path: Path) -> None:
    log: list[str] = []
    drafter: Drafter = object()  # type: ignore[assignment]
    heads = FakeKind("heads", log, drafter=drafter)
    weights = FakeKind("weights", log, deltas=True, key=("w", 1.0))
    catalog = AdapterCatalog([heads, weights])
    catalog.register("both", folder(tmp_path, "heads", "weights"))
    adapter = catalog.resolve("both")
    assert adapter.drafts() and not adapter.ready() and adapter.kv_key() == ("w", 1.0)
    log.clear()
    adapter.load()
    assert adapter.ready() and log == ["load weights", "load heads"]  # claims in removal order
    binding = adapter.binding()
    assert binding.deltas and binding.drafter is drafter
    assert catalog.layer("both", 3) == "weights:3"
    weights.error = InvalidAdapter("gone", file=tmp_path)
    assert adapter.failure() is weights.error
    adapter.release()
    catalog.prefetch("both")
    catalog.close()
    assert log[-6:] == [
        "release weights", "release heads", "prefetch heads", "prefetch weights", "close heads", "close weights"
    ]  # fmt: skip
