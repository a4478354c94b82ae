"""The GGUF block kernels (lifeline/csrc/gguf_ops.cpp) against a dequantize-then-matmul
reference (gguf-py's own dequantization), for every block type they take, odd shapes, and
every kernel path this CPU offers with the faster ones forced off."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from lifeline.model.native import gguf_ops

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
PATHS = {0: "portable", 1: "avx2", 2: "avx-vnni", 3: "avx512-vnni"}
FP16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert gguf_ops(), "the GGUF kernels did not build (see the warning)"
    yield
    torch.ops.lifeline_gguf.gguf_force_path(-1)


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random quants with finite, modest fp16 scales: every bit pattern of the quants occurs."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[..., at:at + 2] = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(
            np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def dequantized(w: torch.Tensor, qtype: T, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(w.numpy(), qtype)
    return torch.from_numpy(np.array(values, dtype=np.float64)).reshape(w.shape[0], cols)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: int8 with one scale per 32 values (round half away from zero
    vs to even differs only at exact halves, which random floats do not hit)."""
    blocks = x.double().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, blocks / scale, 0).round()
    return (q * scale).reshape(x.shape)


def available_paths() -> list[int]:
    """The paths this CPU runs: forcing one it lacks gives a lower one (a Zen 4 has AVX-512
    VNNI but not AVX-VNNI)."""
    best = torch.ops.lifeline_gguf.gguf_force_path(-1)
    paths = [p for p in range(best + 1) if torch.ops.lifeline_gguf.gguf_force_path(p) == p]
    torch.ops.lifeline_gguf.gguf_force_path(-1)
    return paths


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,batch", [(1, 1), (7, 1), (33, 3), (64, 17)])
def test_gguf_linear_is_the_dequantized_product_on_every_path(qtype, rows, batch):
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block == 256 else 5 * block  # not a multiple of the other block size
    w = random_blocks(qtype, rows, cols, seed=rows)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
    exact = q8_activations(x) @ dequantized(w, qtype, cols).T
    loose = x.double() @ dequantized(w, qtype, cols).T
    magnitude = (x.double().abs() @ dequantized(w, qtype, cols).abs().T).norm()
    for path in available_paths():
        assert torch.ops.lifeline_gguf.gguf_force_path(path) == path
        y = torch.ops.lifeline_gguf.gguf_linear(x, w, int(qtype), rows)
        assert y.shape == (batch, rows) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max(),
                                   msg=lambda m: f"{PATHS[path]}: {m}")
        # and the activations' quantization costs little against the float product
        rel = (y.double() - loose).norm() / magnitude
        assert rel < 0.01, f"{PATHS[path]}: {rel:.4f} of the products' magnitude"
    torch.ops.lifeline_gguf.gguf_force_path(-1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_get_rows_is_the_dequantized_rows(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block == 256 else 3 * block
    w = random_blocks(qtype, 10, cols)
    ids = torch.tensor([[9, 0], [3, 3]])
    rows = torch.ops.lifeline_gguf.gguf_get_rows(w, int(qtype), ids, cols)
    assert rows.shape == (2, 2, cols)
    torch.testing.assert_close(rows.double(), dequantized(w, qtype, cols)[ids], rtol=1e-6, atol=1e-7)


def test_bad_shapes_and_types_are_errors_not_crashes():
    w = random_blocks(T.Q8_0, 4, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        torch.ops.lifeline_gguf.gguf_linear(x, w, int(T.Q2_K), 4)
    with pytest.raises(RuntimeError, match="bytes"):
        torch.ops.lifeline_gguf.gguf_linear(torch.randn(2, 96), w, int(T.Q8_0), 4)
    with pytest.raises(RuntimeError, match="whole number of blocks"):
        torch.ops.lifeline_gguf.gguf_linear(torch.randn(2, 40), w, int(T.Q8_0), 4)
    with pytest.raises(RuntimeError, match="out of"):
        torch.ops.lifeline_gguf.gguf_get_rows(w, int(T.Q8_0), torch.tensor([4]), 64)
    with pytest.raises(RuntimeError, match="out of"):
        torch.ops.lifeline_gguf.gguf_get_rows(w, int(T.Q8_0), torch.tensor([-1]), 64)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_dequantize_is_gguf_py_on_every_path(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block == 256 else 3 * block
    w = random_blocks(qtype, 9, cols, seed=3)
    ref = dequantized(w, qtype, cols)
    for path in available_paths():
        assert torch.ops.lifeline_gguf.gguf_force_path(path) == path
        f32 = torch.ops.lifeline_gguf.gguf_dequantize(w, int(qtype), cols, False)
        torch.testing.assert_close(f32.double(), ref, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{PATHS[path]}: {m}")
        bf16 = torch.ops.lifeline_gguf.gguf_dequantize(w, int(qtype), cols, True)
        assert bf16.dtype == torch.bfloat16
        # rounded to nearest as torch rounds float32 to bfloat16
        assert torch.equal(bf16, f32.to(torch.bfloat16)), PATHS[path]
    torch.ops.lifeline_gguf.gguf_force_path(-1)


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_large_batches_take_the_gemm_road_with_the_same_product(qtype, bf16):
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block == 256 else 5 * block
    w = random_blocks(qtype, 24, cols, seed=5)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(5))
    loose = x.double() @ dequantized(w, qtype, cols).T
    magnitude = (x.double().abs() @ dequantized(w, qtype, cols).abs().T).norm()
    try:
        assert torch.ops.lifeline_gguf.gguf_set_gemm(32, bf16) == 32
        big = torch.ops.lifeline_gguf.gguf_linear(x, w, int(qtype), 24)
        small = torch.ops.lifeline_gguf.gguf_linear(x[:31], w, int(qtype), 24)
    finally:
        torch.ops.lifeline_gguf.gguf_set_gemm(0, False)
    direct = torch.ops.lifeline_gguf.gguf_linear(x[:31], w, int(qtype), 24)
    assert torch.equal(small, direct)  # below the threshold: the dot kernels, untouched
    rel = (big.double() - loose).norm() / magnitude
    assert rel < (0.005 if bf16 else 1e-6), rel


REPACKED = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0]
"""The types `gguf_repack` interleaves eight rows at a time (the one-row product's layout)."""


def repacked(w: torch.Tensor, qtype: T, cols: int) -> tuple[torch.Tensor, int]:
    packed_type = torch.ops.lifeline_gguf.gguf_repacked_type(int(qtype))
    assert packed_type >= 0
    return torch.ops.lifeline_gguf.gguf_repack(w, int(qtype), cols), packed_type


def test_only_the_types_with_an_interleaved_layout_are_repacked():
    for qtype in TYPES:
        assert (torch.ops.lifeline_gguf.gguf_repacked_type(int(qtype)) >= 0) == (qtype in REPACKED)
    with pytest.raises(RuntimeError, match="no repacked layout"):
        torch.ops.lifeline_gguf.gguf_repack(random_blocks(T.Q6_K, 8, 256), int(T.Q6_K), 256)


@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 8, 13])
def test_repacked_weights_hold_the_same_values_on_every_path(qtype, rows):
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block == 256 else 3 * block
    w = random_blocks(qtype, rows, cols, seed=rows)
    packed, packed_type = repacked(w, qtype, cols)
    assert packed.shape[0] == (rows + 7) // 8
    ref = dequantized(w, qtype, cols)
    for path in available_paths():
        assert torch.ops.lifeline_gguf.gguf_force_path(path) == path
        values = torch.ops.lifeline_gguf.gguf_dequantize(packed, packed_type, cols, False)
        assert values.shape == ((rows + 7) // 8 * 8, cols)
        # the stored layout's own dequantization, bit for bit, and zeros in the padding rows
        assert torch.equal(values[:rows], torch.ops.lifeline_gguf.gguf_dequantize(
            w, int(qtype), cols, False)), PATHS[path]
        assert not values[rows:].any()
        torch.testing.assert_close(values[:rows].double(), ref, rtol=1e-6, atol=1e-7)
    torch.ops.lifeline_gguf.gguf_force_path(-1)


@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,batch", [(1, 1), (13, 1), (33, 3), (64, 17)])
def test_repacked_product_is_the_dequantized_product_on_every_path(qtype, rows, batch):
    block = GGML_QUANT_SIZES[qtype][0]
    cols = 2 * block if block == 256 else 5 * block
    w = random_blocks(qtype, rows, cols, seed=rows + 1)
    packed, packed_type = repacked(w, qtype, cols)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
    exact = q8_activations(x) @ dequantized(w, qtype, cols).T
    for path in available_paths():
        assert torch.ops.lifeline_gguf.gguf_force_path(path) == path
        y = torch.ops.lifeline_gguf.gguf_linear(x, packed, packed_type, rows)
        assert y.shape == (batch, rows)
        torch.testing.assert_close(y.double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max(),
                                   msg=lambda m: f"{PATHS[path]}: {m}")
    torch.ops.lifeline_gguf.gguf_force_path(-1)
    # the GEMM road decodes the repacked layout to the same matrix
    try:
        torch.ops.lifeline_gguf.gguf_set_gemm(1, False)
        big = torch.ops.lifeline_gguf.gguf_linear(x, packed, packed_type, rows)
    finally:
        torch.ops.lifeline_gguf.gguf_set_gemm(0, False)
    loose = x.double() @ dequantized(w, qtype, cols).T
    assert (big.double() - loose).abs().max() <= 1e-5 * max(1.0, loose.abs().max())


def test_repacked_shapes_are_checked():
    w = random_blocks(T.Q4_1, 16, 64)
    packed, packed_type = repacked(w, T.Q4_1, 64)
    with pytest.raises(RuntimeError, match="repacked weights of 17 rows"):
        torch.ops.lifeline_gguf.gguf_linear(torch.randn(1, 64), packed, packed_type, 17)
    with pytest.raises(RuntimeError, match="repacked weights of 16 rows of 96"):
        torch.ops.lifeline_gguf.gguf_linear(torch.randn(1, 96), packed, packed_type, 16)


def test_the_gemm_road_starts_where_this_cpu_decodes_faster_than_it_dots():
    """From 8 rows in bfloat16 with AMX; elsewhere from 32 (bfloat16 where the CPU has it):
    without AMX the block kernels win at 16 rows (a 16-user decode step)."""
    from lifeline.model.gguf_rows import (
        GEMM_MIN_ROWS,
        GEMM_MIN_ROWS_AMX,
        configure_gemm,
        native_bf16,
    )

    try:
        rows, bf16 = configure_gemm()
        assert bf16 == native_bf16()
        amx = bf16 and torch.cpu._is_amx_tile_supported()
        assert rows == (GEMM_MIN_ROWS_AMX if amx else GEMM_MIN_ROWS)
        assert GEMM_MIN_ROWS > 16 >= GEMM_MIN_ROWS_AMX
    finally:
        torch.ops.lifeline_gguf.gguf_set_gemm(0, False)
