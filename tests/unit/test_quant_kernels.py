"""Products with GGUF block-format weights (kernels/quant.py) against the gguf package.

The gguf package (llama.cpp's own Python reader) is the oracle for the
formats: its dequantizer gives each weight's value. With activations left in
float32 a product must equal the float64 product of those values to
rounding; with activations quantized to int8 (as llama.cpp does) the
difference is bounded by the activation rounding: at most half a step of
each block's scale per value, times the block's weights.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
import pytest

from kernels import cpu
from kernels.quant import BLOCKS, QuantizedMatrix, QuantizedWeight, QuantType
from kernels.settings import configure, settings
from tests.support.quant_blocks import random_blocks

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="no C compiler to build kernels/cpu with")

TYPES = list(QuantType)


def oracle(qtype: QuantType, data: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype)).astype(np.float64)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_dequantize_as_gguf_does(qtype: QuantType) -> None:
    k = 512
    data = random_blocks(qtype, 6, k, seed=int(qtype))
    matrix = QuantizedMatrix(qtype, data, 6, k)
    np.testing.assert_allclose(matrix.dequantize(), oracle(qtype, data), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(matrix.take_rows(np.array([5, 0, 5])), oracle(qtype, data)[[5, 0, 5]], rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, 17])
def test_products_with_float32_activations_equal_the_dequantized_product(qtype, n, monkeypatch) -> None:
    monkeypatch.setattr(settings, "quantize_activations", False)
    m, k = 37, 512
    data = random_blocks(qtype, m, k, seed=n)
    bias = np.random.default_rng(1).standard_normal(m).astype(np.float32)
    x = np.random.default_rng(2).standard_normal((n, k)).astype(np.float32)
    got = QuantizedWeight([QuantizedMatrix(qtype, data, m, k)], bias).matmul(x)
    expected = x.astype(np.float64) @ oracle(qtype, data).T + bias
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def activation_rounding_bound(qtype: QuantType, weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """[n, m] bounds on |int8 product - exact product|: every activation value is off by at
    most half its block's step (max|x| / 127 over the block: 32 values, or 256 for the K
    formats); each weight multiplies that. Plus float32 slack (all there is for F32 and F16,
    whose products take the activations as they are)."""
    block = BLOCKS[qtype][0]
    if block == 1:
        return 1e-5 * (np.abs(x) @ np.abs(weights).T)
    n, k = x.shape
    step = np.abs(x).reshape(n, k // block, block).max(axis=2) / 127.0  # [n, blocks]
    per_block = np.abs(weights).reshape(weights.shape[0], k // block, block).sum(axis=2)  # [m, blocks]
    return 0.5 * step @ per_block.T + 1e-5 * (np.abs(x) @ np.abs(weights).T)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 5])
def test_products_with_int8_activations_stay_within_the_rounding_bound(qtype, n) -> None:
    m, k = 29, 768 if BLOCKS[qtype][0] == 32 else 512
    data = random_blocks(qtype, m, k, seed=10 + n)
    x = np.random.default_rng(3).standard_normal((n, k)).astype(np.float32)
    weights = oracle(qtype, data)
    got = QuantizedWeight([QuantizedMatrix(qtype, data, m, k)]).matmul(x)
    exact = x.astype(np.float64) @ weights.T
    error = np.abs(got - exact)
    assert (error <= activation_rounding_bound(qtype, weights, x)).all(), error.max()
    if BLOCKS[qtype][0] > 1:
        assert error.max() > 0  # the activations really were rounded


def test_a_weight_of_parts_of_several_formats_writes_each_part_in_place() -> None:
    """Fused q/k/v whose parts were quantized differently (Q4_K_M files do that)."""
    k = 512
    blocks = [(t, random_blocks(t, rows, k, seed=rows)) for t, rows in [(QuantType.Q4_K, 8), (QuantType.Q6_K, 4),
                                                                        (QuantType.Q8_0, 4)]]
    parts = [QuantizedMatrix(t, data, data.shape[0], k) for t, data in blocks]
    weight = QuantizedWeight(parts, np.arange(16, dtype=np.float32))
    x = np.random.default_rng(4).standard_normal((3, k)).astype(np.float32)
    out = np.full((3, 20), np.nan, np.float32)
    weight.matmul(x, out[:, 2:18])  # a strided view, as a slice of a wider buffer
    for part, start in zip(parts, (0, 8, 12)):
        alone = QuantizedWeight([part], np.arange(start, start + part.rows, dtype=np.float32)).matmul(x)
        np.testing.assert_array_equal(out[:, 2 + start : 2 + start + part.rows], alone)
    assert np.isnan(out[:, :2]).all() and np.isnan(out[:, 18:]).all()
    np.testing.assert_allclose(weight.dequantize(), np.concatenate([oracle(t, data) for t, data in blocks]), rtol=1e-6)


def test_malformed_data_is_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 256"):
        QuantizedMatrix(QuantType.Q4_K, np.zeros((2, 144), np.uint8), 2, 100)
    with pytest.raises(ValueError, match="does not hold 3 rows"):
        QuantizedMatrix(QuantType.Q8_0, np.zeros((2, 34), np.uint8), 3, 32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_packed_in_another_order(qtype: QuantType) -> None:
    """llama.cpp's q/k rows are put back in order while they are packed."""
    k, rows = 256, 21
    data = random_blocks(qtype, rows, k, seed=5)
    order = np.random.default_rng(6).permutation(rows)
    matrix = QuantizedMatrix(qtype, data, rows, k, order)
    np.testing.assert_allclose(matrix.dequantize(), oracle(qtype, data)[order], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="row order"):
        QuantizedMatrix(qtype, data, rows, k, order[:-1])


@pytest.mark.parametrize("n", [63, 64, 70, 131])
def test_products_of_many_rows_span_several_passes(n: int) -> None:
    """A prefill chunk: activation rows in passes of 64, groups within them, and a last
    tile of fewer than 16 weight rows; each output row equals that row's product alone."""
    k, m = 256, 45
    weight = QuantizedWeight([QuantizedMatrix(QuantType.Q4_0, random_blocks(QuantType.Q4_0, m, k, seed=n), m, k)])
    x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    together = weight.matmul(x)
    for i in (0, 1, n // 2, n - 2, n - 1):
        np.testing.assert_array_equal(together[i], weight.matmul(x[i : i + 1])[0])


@pytest.mark.parametrize("qtype", [QuantType.Q2_K, QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K, QuantType.IQ4_XS],
                         ids=lambda t: t.name)
def test_a_lone_rows_software_prefetch_changes_no_bit(qtype: QuantType) -> None:
    """A lone row's tiles are prefetched by software or not as the CPU streams them faster
    (kernels/cpu.lone_row_prefetch); either way the product has the same bits, those of the
    row in a batch."""
    m, k = 40, 512
    weight = QuantizedWeight([QuantizedMatrix(qtype, random_blocks(qtype, m, k, seed=5), m, k)])
    x = np.random.default_rng(5).standard_normal((3, k)).astype(np.float32)
    lone = {}
    try:
        for on in (False, True):
            configure(lone_row_prefetch=on)
            lone[on] = weight.matmul(x[:1])[0]
    finally:
        configure(lone_row_prefetch=None)
    np.testing.assert_array_equal(lone[False], lone[True])
    np.testing.assert_array_equal(lone[True], weight.matmul(x)[0])


def test_a_lone_row_is_prefetched_by_software_where_the_cpu_lacks_avx512() -> None:
    assert cpu.lone_row_prefetch({"avx2", "fma", "f16c"}) is True
    assert cpu.lone_row_prefetch({"avx2", "fma", "f16c", "avx512f", "avx512bw"}) is False


# Each vector path of quant_kernels.c, built for a CPU that has it (the machine running the
# tests must have its extensions: AVX-512 without VNNI needs an AVX-512 CPU, and so on). The
# AVX2 + AVX-VNNI path also runs on any AVX2 CPU with its one VNNI instruction computed by AVX2
# (tests/support/c/avxvnni_emulated.h): its own code, all of it but that instruction.
EMULATED_VNNI = Path(__file__).resolve().parents[1] / "support" / "c" / "avxvnni_emulated.h"
# The portable path at -O1: at -O3 the compiler takes a minute over its scalar lanes on a slow
# CPU, and without -ffast-math (and with -ffp-contract=off) no optimisation level changes a result.
VARIANTS = {"portable": ["-march=x86-64", "-O1"], "avx2": ["-march=haswell"], "avx512": ["-march=skylake-avx512"],
            "avxvnni": ["-march=haswell", "-mavxvnni"],
            "avxvnni-emulated": ["-march=haswell", "-include", str(EMULATED_VNNI)],
            "avx512vnni": ["-march=skylake-avx512", "-mavx512vnni"], "native": ["-march=native"]}
PATHS = {"portable": 0, "avx2": 1, "avxvnni": 2, "avxvnni-emulated": 2, "avx512": 3, "avx512vnni": 4}

AVX2 = {"avx2", "fma", "f16c"}
AVX512 = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
# What each variant's -march needs of the CPU (/proc/cpuinfo's names): without them it is not built.
NEEDS = {"portable": set(), "avx2": AVX2, "avxvnni": AVX2 | {"avx_vnni"}, "avxvnni-emulated": AVX2,
         "avx512": AVX512, "avx512vnni": AVX512 | {"avx512_vnni"}, "native": set()}


@functools.cache
def _built(name: str):
    """The library built for variant ``name``, or None where it does not run on this CPU (built,
    and found out, once per session: a build this CPU cannot run is never cached on disk). The
    native variant is the library the kernels load."""
    from kernels.cpu import FLAGS, ISA_SOURCE, LIBRARY, OPENMP_VARIANTS, QUANT_SOURCE
    from kernels.cpu.library import NativeLibrary, cpu_flags

    if name == "native":
        return cpu.load()
    if not NEEDS[name] <= (cpu_flags() or set()):
        return None
    flags = [g for f in FLAGS for g in (VARIANTS[name] if f == "-march=native" else [f])]
    headers = [*LIBRARY.headers, *([EMULATED_VNNI] if name == "avxvnni-emulated" else [])]  # the cache's key
    # The products' source and the one reporting the build's extensions (built_isa) suffice.
    return NativeLibrary(f"quant-{name}", [QUANT_SOURCE, ISA_SOURCE], flags, OPENMP_VARIANTS, headers).load()


def _variant(name: str):
    if name != "native" and _built("native").quant_vector_path() == PATHS[name]:
        # Its code is this CPU's own build's (the same #if branches), which every other test runs:
        # compared with itself, it would only cost a compile.
        pytest.skip(f"this CPU's own build runs the {name} path")
    lib = _built(name)
    if lib is None:
        pytest.skip(f"the {name} build does not run on this CPU")
    return lib


@pytest.mark.parametrize("variant", list(PATHS))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_vector_path_computes_the_same_bits(variant: str, qtype: QuantType) -> None:
    """The AVX-512 (with VNNI and without), AVX2 (with AVX-VNNI and without) and portable paths
    against this CPU's own build: the same packed bytes, the same quantized activations, the same
    float32 results to the bit."""
    other, native = _variant(variant), _variant("native")
    assert other.quant_vector_path() == PATHS[variant]
    m, k = 37, 512
    data = random_blocks(qtype, m, k, seed=20)
    bias = np.random.default_rng(22).standard_normal(m).astype(np.float32)
    # A lone row with its software prefetch and without (tile_row_prefetched: copies of the tile
    # kernels of their own), and the kernels of several rows at once.
    for n, prefetch in ((1, False), (1, True), (2, False), (7, False)):
        x = np.random.default_rng(21 + n).standard_normal((n, k)).astype(np.float32)
        try:
            configure(lone_row_prefetch=prefetch)  # the native library's, as the server sets it
            other.set_lone_row_prefetch(prefetch)
            results = [_product(lib, qtype, data, x, bias) for lib in (native, other)]
        finally:
            configure(lone_row_prefetch=None)
        for ours, theirs in zip(*results):
            np.testing.assert_array_equal(ours, theirs)
    exact = x.astype(np.float64) @ oracle(qtype, data).T + bias
    assert (np.abs(results[1][2] - exact) <= activation_rounding_bound(qtype, oracle(qtype, data), x)).all()


def _product(lib, qtype: QuantType, data: np.ndarray, x: np.ndarray, bias: np.ndarray):
    """The packed weights, quantized activations and products of one library."""
    (m, _), (n, k) = data.shape, x.shape
    packed = np.empty(lib.packed_bytes(qtype, m, k), np.uint8)
    lib.pack_matrix(qtype, data.ctypes.data, m, k, None, packed.ctypes.data, 2)
    xq = np.empty((n, lib.activation_row_bytes(qtype, k)), np.uint8)
    lib.quantize_activations(qtype, x.ctypes.data, n, k, xq.ctypes.data, 2)
    out = np.empty((n, m), np.float32)
    inputs = x if BLOCKS[qtype][0] == 1 else xq  # F32 and F16 take the activations as they are
    lib.quant_matmul(qtype, packed.ctypes.data, m, k, inputs.ctypes.data, n, out.ctypes.data, m, bias.ctypes.data, 2)
    return packed, xq, out
