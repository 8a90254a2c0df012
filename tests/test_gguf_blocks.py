"""GGUF block types (a3b_core/kernels/gguf_blocks.py): dequantized and multiplied from their bytes, by the numba
kernels and by the fallback (gguf-py and torch), against gguf-py's dequantization (llama.cpp's reference)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from a3b_core.errors import CheckpointError
from a3b_core.kernels import gguf_blocks
from a3b_core.kernels.cpu_linear import many_rows_weight_dtype
from a3b_core.kernels.gguf_blocks import (blocks_product, computes_step, dequantize_blocks, kernel_rows,
                                          product_bound, random_blocks, routed_step, row_bytes)
from a3b_core.kernels.gguf_types import BLOCK_TYPES, Q4_0, Q4_K, Q6_K, Q8_0
from a3b_core.release.gguf_file import TENSOR_TYPES
from tests.quantized_gguf import QUANTIZED_BY_GGUF_PY  # the others are random valid blocks


@pytest.fixture(params=["numba", "fallback"])
def path(request, monkeypatch):
    """Each test runs on the numba kernels and on the fallback (numba switched off as A3B_NO_NUMBA=1 does)."""
    if request.param == "numba":
        if gguf_blocks.kernels() is None:
            pytest.skip("numba is not installed or its kernels did not compile")
    else:
        monkeypatch.setenv("A3B_NO_NUMBA", "1")
    return request.param


def matrix_blocks(type_id: int, rows: int, blocks_a_row: int, seed: int) -> tuple[np.ndarray, int]:
    """(blocks [rows, row_bytes], cols): a random matrix quantized by gguf-py where it can, else random valid blocks."""
    generator = np.random.default_rng(seed)
    cols = blocks_a_row * BLOCK_TYPES[type_id][1]
    if type_id in QUANTIZED_BY_GGUF_PY:
        weights = generator.standard_normal((rows, cols), dtype=np.float32)
        return np.ascontiguousarray(quantize(weights, GGMLQuantizationType(type_id))), cols
    return random_blocks(type_id, rows, cols, generator), cols


def test_table_matches_the_file_reader():
    for type_id, entry in BLOCK_TYPES.items():
        assert TENSOR_TYPES[type_id] == entry
        assert row_bytes(type_id, 2 * entry[1]) == 2 * entry[2]


@pytest.mark.parametrize("type_id", list(BLOCK_TYPES), ids=[name for name, _, _ in BLOCK_TYPES.values()])
@pytest.mark.parametrize("blocks_a_row", [2, 3])
def test_dequantize_equals_gguf_py(type_id, blocks_a_row, path):
    blocks, cols = matrix_blocks(type_id, 37, blocks_a_row, seed=type_id)
    want = dequantize(blocks, GGMLQuantizationType(type_id))
    got = dequantize_blocks(type_id, blocks, cols)
    assert got.dtype == torch.float32 and got.shape == (37, cols)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("type_id", list(BLOCK_TYPES), ids=[name for name, _, _ in BLOCK_TYPES.values()])
@pytest.mark.parametrize("count", [1, 3, 60])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "coded"])
def test_product_equals_reference(type_id, count, exact, path):
    """Products of few rows (the kernels') and many (the dequantized matrix's), of an fp32 model's rows (exact) and a
    bf16 model's (the coded types' int8 codes)."""
    blocks, cols = matrix_blocks(type_id, 21, 3, seed=100 + type_id)  # 21 rows: a partial work item of 16
    weights = dequantize(blocks, GGMLQuantizationType(type_id)).astype(np.float64)
    x = torch.randn(count, cols, generator=torch.Generator().manual_seed(count))
    want = x.double().numpy() @ weights.T
    got = blocks_product(type_id, blocks, x, exact)
    assert got.dtype == torch.float32 and got.shape == (count, 21)
    # fp32 sums of cols products, and the coded kernels' int8 codes of the inputs (product_bound)
    assert np.all(np.abs(got.numpy() - want) <= product_bound(type_id, x.numpy(), weights, exact) + 1e-30)


def test_kernel_row_results_do_not_depend_on_the_batch():
    """The kernel's result for a decoding row is the same alone or among others (torch's products, the fallback, do
    not promise this)."""
    if gguf_blocks.kernels() is None:
        pytest.skip("numba is not installed or its kernels did not compile")
    blocks, cols = matrix_blocks(Q4_K, 40, 2, seed=1)
    x = torch.randn(48, cols, generator=torch.Generator().manual_seed(2))
    assert kernel_rows(Q4_K, x, False) == len(x)
    together = blocks_product(Q4_K, blocks, x, False)
    alone = torch.cat([blocks_product(Q4_K, blocks, x[t:t + 1], False) for t in range(len(x))])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("type_id", [Q4_K, Q6_K, Q8_0], ids=["Q4_K", "Q6_K", "Q8_0"])
def test_vector_dots_equal_the_loop_dots(type_id):
    """The hand-written vector dots (gguf_vector.py) and the loops CPUs without AVX2 and F16C run give one result, up to
    fp32 rounding; the blocks' fp16 scales include subnormal ones."""
    compiled = gguf_blocks.kernels()
    if compiled is None or not compiled.VECTOR_TYPES:
        pytest.skip("the vector dots need numba and a CPU with AVX2 and F16C")
    from numba import njit

    @njit
    def both(type_id, blocks, codes, extra):
        out = np.empty((2, blocks.shape[0]), np.float32)
        for r in range(blocks.shape[0]):
            out[0, r] = compiled.loop_coded_dot(type_id, blocks[r], codes[0], extra[0])
            out[1, r] = compiled.vector_coded_dot(type_id, blocks[r], codes[0], extra[0])
        return out

    blocks, cols = matrix_blocks(type_id, 24, 3, seed=7)
    scale_at = {Q4_K: 0, Q6_K: 208, Q8_0: 0}[type_id]
    blocks[::3, scale_at:scale_at + 2] = [3, 0]  # d = 3 * 2^-24, a subnormal fp16, in every third row's first block
    x = np.random.default_rng(8).standard_normal((1, cols), dtype=np.float32)
    extra, codes = compiled.coded_bytes(x)
    loop, vector = both(type_id, blocks, codes, extra)
    weights = dequantize(blocks, GGMLQuantizationType(type_id))
    bound = np.abs(x) @ np.abs(weights).T
    assert np.all(np.abs(loop - vector) <= 1e-5 * bound[0] + 1e-30)


@pytest.mark.parametrize("type_id", [Q4_K, Q8_0], ids=["Q4_K", "Q8_0"])
def test_vnni_dots_equal_the_pmadd_dots(type_id):
    """Where the CPU has AVX-512 VNNI, Q4_K's and Q8_0's runs are summed by vpdpbusd; the pmaddubsw and pmaddwd code
    that CPUs with AVX2 alone run gives the same integers, hence the same result, bit for bit."""
    compiled = gguf_blocks.kernels()
    if compiled is None or not compiled.VECTOR_TYPES:
        pytest.skip("the vector dots need numba and a CPU with AVX2 and F16C")
    from numba import njit

    from a3b_core.kernels import gguf_vector
    if not gguf_vector.VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI: its dots are the pmaddubsw ones")
    vnni_row, pmadd_row = (gguf_vector.row_intrinsic(type_id, vnni) for vnni in (True, False))

    @njit
    def both(blocks, codes, extra, count):
        out = np.empty((2, blocks.shape[0]), np.float32)
        for r in range(blocks.shape[0]):
            out[0, r] = vnni_row(blocks[r], codes, extra, count)
            out[1, r] = pmadd_row(blocks[r], codes, extra, count)
        return out

    blocks, cols = matrix_blocks(type_id, 24, 3, seed=9)
    x = np.random.default_rng(10).standard_normal((1, cols), dtype=np.float32)
    extra, codes = compiled.coded_bytes(x)
    vnni, pmadd = both(blocks, codes[0], extra[0], cols // BLOCK_TYPES[type_id][1])
    assert np.array_equal(vnni, pmadd)


def test_bad_inputs_name_the_type_and_fix():
    blocks, cols = matrix_blocks(Q4_0, 2, 2, seed=0)
    with pytest.raises(CheckpointError, match="type id 16"):
        dequantize_blocks(16, blocks, cols)
    with pytest.raises(CheckpointError, match="whole blocks of 32"):
        row_bytes(Q4_0, 48)
    with pytest.raises(CheckpointError, match=r"\[rows, 36\]"):
        dequantize_blocks(Q4_0, blocks[:, :30].copy(), cols)
    with pytest.raises(ValueError, match="float32"):
        blocks_product(Q4_0, blocks, torch.ones(1, cols, dtype=torch.float64), True)


@pytest.mark.parametrize("types", [(Q4_K, Q4_K, Q6_K), (Q8_0, Q8_0, Q8_0), (Q4_K, Q6_K, Q4_K)],
                         ids=["Q4_K_M", "Q8_0", "mixed"])
def test_routed_step_equals_the_experts_one_by_one(types):
    """The one-call decoding step of GGUF experts (Q4_K_M's and Q8_0's types) against each expert's SwiGLU computed
    from gguf-py's dequantized weights, in float64."""
    if not computes_step(types, torch.zeros(2, 1, dtype=torch.bfloat16)):
        pytest.skip("numba is not installed or its kernels did not compile")
    experts, hidden, inter, generator = 4, 512, 256, np.random.default_rng(5)

    def stack(type_ids, rows, cols):
        parts = [[matrix_blocks(t, rows, cols // BLOCK_TYPES[t][1], seed=int(generator.integers(1 << 30)))[0]
                  for t in type_ids] for _ in range(experts)]
        blocks = np.stack([np.concatenate([p.reshape(-1) for p in matrices]) for matrices in parts])
        weights = [np.concatenate([dequantize(p, GGMLQuantizationType(t)) for p, t in zip(matrices, type_ids)])
                   for matrices in parts]
        return blocks, np.stack(weights).astype(np.float64)

    gate_up, gate_up_w = stack(types[:2], inter, hidden)
    down, down_w = stack(types[2:], hidden, inter)
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 3], [2, 0]])
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6]])
    sizes = (row_bytes(types[0], hidden), row_bytes(types[1], hidden), row_bytes(types[2], inter))
    got = routed_step(types, sizes, inter, gate_up, down, x, ids, weights)
    want = np.zeros((2, hidden))
    for t in range(2):
        for e, p in zip(ids[t].tolist(), weights[t].double().tolist()):
            h = gate_up_w[e] @ x[t].double().numpy()
            act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
            want[t] += p * (down_w[e] @ act)
    # the inputs and the SiLU products coded as int8 (product_bound), as llama.cpp codes them: measured 1.0-1.3% of
    # the largest |output| on these random matrices
    scale = np.abs(want).max()
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=2.5e-2 * scale)


@pytest.mark.parametrize("type_id", [Q4_K, Q4_0], ids=["Q4_K", "Q4_0"])
def test_bf16_dequantization_rounds_as_torch(type_id, path):
    """The bf16 weights many-row products multiply are the fp32 weights rounded as torch rounds them."""
    blocks, cols = matrix_blocks(type_id, 37, 2, seed=3)
    want = torch.from_numpy(dequantize(blocks, GGMLQuantizationType(type_id))).bfloat16()
    assert torch.equal(dequantize_blocks(type_id, blocks, cols, torch.bfloat16), want)


def test_many_bf16_rows_multiply_the_weights_in_the_product_dtype(path):
    """A bf16 model's product of many rows is torch's product of the dequantized weights: in bf16 where oneDNN
    multiplies bf16, else in fp32 from the exact weights, rounded to bf16 once."""
    blocks, cols = matrix_blocks(Q4_K, 21, 2, seed=4)
    weights = torch.from_numpy(dequantize(blocks, GGMLQuantizationType(Q4_K)))
    x = torch.randn(49, cols, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert len(x) > kernel_rows(Q4_K, x, False)
    got = blocks_product(Q4_K, blocks, x, False)
    assert got.dtype == torch.bfloat16
    if many_rows_weight_dtype(x) == torch.bfloat16:
        want = torch.nn.functional.linear(x, weights.bfloat16())
    else:
        want = (x.float() @ weights.T).bfloat16()
    assert torch.equal(got, want)
