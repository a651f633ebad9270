"""service.model.weights.int4_layout: the unpack derived from the packer inverts it, whatever layout the packer uses."""

from __future__ import annotations

import pytest
import torch

from service.model.weights.int4_layout import LayoutError, chunks_concatenate, derive, pack_cpu

pytestmark = pytest.mark.numerics

# Full blocks, remainders of every block size torch uses (16 / 32 / 48 rows), and SmolLM2's projection shapes.
SHAPES = [(64, 128), (48, 96), (32, 64), (16, 32), (80, 64), (112, 96), (960, 576), (576, 1536)]


def _random_q(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_derived_unpack_inverts_the_kernels_packer(n: int, k: int) -> None:
    layout = derive(pack_cpu, n, k)
    q = _random_q(n, k, n + k)
    out = torch.empty(n, k, dtype=torch.uint8)
    assert torch.equal(layout.unpack(pack_cpu(q), out), q.to(torch.uint8))
    assert layout.form == "strided"  # every torch CPU layout so far is row runs: the fast unpack
    wide = torch.empty(n, k, dtype=torch.bfloat16)  # unpacking straight into a compute dtype
    assert torch.equal(layout.unpack(pack_cpu(q), wide), q.to(torch.bfloat16))


def _shuffling_packer(perm: torch.Tensor):  # type: ignore[no-untyped-def]
    """A packer with no row structure: nibble i of the output is value perm[i] of the input."""

    def pack(q: torch.Tensor) -> torch.Tensor:
        flat = q.reshape(-1)[perm].to(torch.uint8)
        return (flat[0::2] | flat[1::2] << 4).view(q.shape[0], -1)

    return pack


def test_a_layout_without_row_structure_is_unpacked_by_a_full_gather() -> None:
    n, k = 32, 64
    pack = _shuffling_packer(torch.randperm(n * k, generator=torch.Generator().manual_seed(1)))
    layout = derive(pack, n, k)
    assert layout.form == "gather"
    q = _random_q(n, k, 2)
    assert torch.equal(layout.unpack(pack(q), torch.empty(n, k, dtype=torch.uint8)), q.to(torch.uint8))


def test_a_packer_that_loses_values_is_refused() -> None:
    def lossy(q: torch.Tensor) -> torch.Tensor:
        flat = q.reshape(-1).to(torch.uint8)
        flat = torch.cat((flat[:1], flat[:-1]))  # value 0 twice, the last value gone
        return (flat[0::2] | flat[1::2] << 4).view(q.shape[0], -1)

    with pytest.raises(LayoutError, match="not a permutation"):
        derive(lossy, 16, 32)


def test_chunked_packing_is_checked_against_the_packer() -> None:
    assert chunks_concatenate(pack_cpu, 4096, 64, 0)  # whole blocks of every capability's packer
    assert chunks_concatenate(pack_cpu, 128, 96, 48)

    def reversed_rows(q: torch.Tensor) -> torch.Tensor:  # a packer whose layout depends on the whole height
        return pack_cpu(q.flip(0).contiguous())

    assert not chunks_concatenate(reversed_rows, 64, 64, 16)
