"""kernels.packing: exact round trips and bit-identity with a slow pure-Python bit-stream writer."""

from __future__ import annotations

import math

import pytest
import torch

from vptq_core.kernels.packing import pack_codes, pack_indices, unpack_codes, unpack_indices


def python_bitstream(entries: list[int], width: int) -> list[int]:
    """One row: entry i occupies stream bits [i*width, (i+1)*width), LSB-first in 32-bit words, as int32."""
    words = [0] * math.ceil(len(entries) * width / 32)
    for i, value in enumerate(entries):
        for b in range(width):
            if (value >> b) & 1:
                pos = i * width + b
                words[pos // 32] |= 1 << (pos % 32)
    return [w - (1 << 32) if w >= (1 << 31) else w for w in words]


def python_pack(indices: torch.Tensor, index_bits: int, res: torch.Tensor | None, res_bits: int) -> torch.Tensor:
    rows = indices.reshape(-1, indices.shape[-1]).tolist()
    res_rows = res.reshape(-1, res.shape[-1]).tolist() if res is not None else [[0] * len(r) for r in rows]
    out = [python_bitstream([(r << index_bits) | i for i, r in zip(row, rrow)], index_bits + res_bits)
           for row, rrow in zip(rows, res_rows)]
    return torch.tensor(out, dtype=torch.int32).reshape(*indices.shape[:-1], -1)


@pytest.mark.parametrize("index_bits", range(1, 17))
@pytest.mark.parametrize("res_bits", [0, 1, 5, 8, 16])
def test_pack_indices_matches_python_bitstream_and_round_trips(index_bits: int, res_bits: int) -> None:
    gen = torch.Generator().manual_seed(index_bits * 100 + res_bits)
    shape = (2, 3, 37)  # odd rows / columns so entries straddle words and the tail is partial
    idx = torch.randint(0, 2**index_bits, shape, generator=gen)
    idx[0, 0, 0] = 2**index_bits - 1  # all-ones entries exercise the top bits
    res = torch.randint(0, 2**res_bits, shape, generator=gen) if res_bits else None
    if res is not None:
        res[1, 2, -1] = 2**res_bits - 1
    packed = pack_indices(idx, index_bits, res, res_bits)
    assert packed.dtype == torch.int32
    assert packed.shape == (2, 3, math.ceil(37 * (index_bits + res_bits) / 32))
    torch.testing.assert_close(packed, python_pack(idx, index_bits, res, res_bits), rtol=0, atol=0)
    got_idx, got_res = unpack_indices(packed, index_bits, 37, res_bits)
    assert got_idx.dtype == torch.int64
    torch.testing.assert_close(got_idx, idx, rtol=0, atol=0)
    if res is None:
        assert got_res is None
    else:
        torch.testing.assert_close(got_res, res, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 64, 65, 577])
def test_pack_indices_various_lengths(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    idx = torch.randint(0, 4096, (5, n), generator=gen)
    res = torch.randint(0, 256, (5, n), generator=gen)
    packed = pack_indices(idx, 12, res, 8)
    torch.testing.assert_close(packed, python_pack(idx, 12, res, 8), rtol=0, atol=0)
    got_idx, got_res = unpack_indices(packed, 12, n, 8)
    assert torch.equal(got_idx, idx) and torch.equal(got_res, res)


def test_pack_indices_total_32_bits_uses_full_words() -> None:
    idx = torch.tensor([[0xFFFF, 0, 0x1234]])
    res = torch.tensor([[0xFFFF, 0x8000, 0xABCD]])
    packed = pack_indices(idx, 16, res, 16)
    assert packed.tolist() == [[-1, -(2**31), (0xABCD1234 - 2**32)]]
    got_idx, got_res = unpack_indices(packed, 16, 3, 16)
    assert got_idx.tolist() == idx.tolist() and got_res.tolist() == res.tolist()


def test_pack_indices_known_layout() -> None:
    # 3-bit entries 1..11: entry 10 straddles words 0 and 1 (bits 30..32).
    idx = torch.tensor([list(range(1, 12))]) % 8
    packed = pack_indices(idx, 3)
    expected = sum(int(v) << (3 * i) for i, v in enumerate(idx[0].tolist()))
    low, high = expected & 0xFFFFFFFF, expected >> 32
    assert packed.tolist() == [[low - (1 << 32) if low >= 1 << 31 else low, high]]


def test_pack_codes_round_trip_all_widths() -> None:
    for bits in range(1, 9):
        gen = torch.Generator().manual_seed(bits)
        codes = torch.randint(0, 2**bits, (7, 45), generator=gen, dtype=torch.int64).to(torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.shape == (7, math.ceil(45 * bits / 32))
        torch.testing.assert_close(packed, python_pack(codes.long(), bits, None, 0), rtol=0, atol=0)
        assert torch.equal(unpack_codes(packed, bits, 45), codes.long())


def test_bad_inputs_raise_clear_errors() -> None:
    idx = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="index_bits must be in 1..16, got 17"):
        pack_indices(idx, 17)
    with pytest.raises(ValueError, match="res_bits must be in 0..16, got 17"):
        pack_indices(idx, 8, idx, 17)
    with pytest.raises(ValueError, match=r"indices values must be in \[0, 16\)"):
        pack_indices(idx + 16, 4)
    with pytest.raises(ValueError, match=r"indices values must be in \[0, 16\)"):
        pack_indices(idx - 1, 4)
    with pytest.raises(TypeError, match="indices must be an integer tensor"):
        pack_indices(idx.float(), 4)
    with pytest.raises(ValueError, match="res_bits is 4 but res_indices is None"):
        pack_indices(idx, 4, None, 4)
    with pytest.raises(ValueError, match="res_indices shape"):
        pack_indices(idx, 4, idx[:, :4], 4)
    with pytest.raises(TypeError, match="packed must be int32"):
        unpack_indices(idx, 4, 8)
    with pytest.raises(ValueError, match=r"packed last dimension \(3\) must be ceil\(8\*4/32\) = 1"):
        unpack_indices(torch.zeros(2, 3, dtype=torch.int32), 4, 8)
    with pytest.raises(ValueError, match="bits must be in 1..8, got 9"):
        pack_codes(idx, 9)
    with pytest.raises(ValueError, match="codes must be 2-D"):
        pack_codes(idx[0], 4)
