"""GGUF block-quantized matrices kept as their file's block bytes: dequantized, and multiplied with activation rows,
straight from the blocks.

A matrix of `rows` x `cols` weights is a uint8 array [rows, row_bytes(type_id, cols)]: each row is cols / block_elems
blocks of block_bytes, in the layouts of llama.cpp's ggml (gguf-py's gguf/quants.py reads them the same way and is the
reference here). The types computed are the legacy 32-weight blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) and the
256-weight K blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS).

The numba kernels (gguf_numba.py) are used when numba imports, compiles them and reproduces gguf-py on a small matrix,
unless the environment sets A3B_NO_NUMBA=1 (the rule of formats/kernel_stores.py); otherwise gguf-py dequantizes and
torch multiplies. A product of a few activation rows (kernel_rows) reads each block once and dots its codes with the
activations; more rows dequantize the matrix and make one torch product (in bf16 where the rows are bf16 and
oneDNN multiplies bf16, cpu_linear.many_rows_weight_dtype). In bf16 and fp16 models, Q4_K, Q6_K and
Q8_0 (gguf_numba.CODED_TYPES, what Q4_K_M and Q8_0 files hold) are multiplied in integers, the activations coded as
int8 per 32 inputs as llama.cpp codes them (in gguf_vector.py's vector code where the CPU has AVX2 and F16C), and a
decoding step's routed experts of these types are computed in one call (routed_step); fp32 models (the reference
mode) multiply the exact weights.

bench/gguf_blocks.py, a 2048 x 2048 matrix and one activation row on 2 threads of an AMD EPYC (AVX2), against
torch's bf16 matrix-vector product of the same matrix (0.41-0.51 ms, 16-20 GB/s): Q4_K 0.15-0.18 ms (13-16 GB/s
of blocks), Q6_K 0.16-0.17 ms (20-22 GB/s), Q8_0 0.13-0.22 ms (20-34 GB/s), the activations' coding and the call
included; the other types, decoded to fp32 and multiplied in fp32, 3.9-6.8 ms (0.3-0.8 GB/s). dequantize_rows makes
the fp32 matrix in 1.2-2.7 ms (Q4_K, Q6_K, Q8_0) to 4 ms (the others). On an AMD EPYC with AVX-512 (bf16, VNNI),
the same: bf16 0.23 ms (36 GB/s), Q4_K 0.10 ms (24 GB/s), Q6_K 0.10 ms (33 GB/s), Q8_0 0.10-0.13 ms (33-45 GB/s),
with the kernels' AVX2 instructions (pairing two runs of 32 inputs in 512-bit ones measured slower there: Q6_K 0.16
against 0.10 ms, Q4_K 0.11 against 0.10). dequantize_rows_bf16 makes a 4096 x 2048 bf16 matrix in 0.9 ms (Q4_K),
1.1 ms (Q6_K), 2.2 ms (Q8_0).
"""
from __future__ import annotations

from functools import cache
from types import ModuleType

import numpy as np
import torch

from ..errors import CheckpointError
from .arrays import BlockMatrix, plain_cpu
from .cpu_linear import many_rows_product, many_rows_weight_dtype
from .gguf_types import BLOCK_TYPES, Q2_K, Q3_K, Q4_1, Q4_K, Q5_1, Q5_K, Q6_K, Q8_0
from .numba_threads import LOCK, checked_module, numba_allowed, set_threads

# a decoding step of at most this many rows computes its routed experts in one call (routed_step)
FEW_ROWS = 16
# products of at most this many activation rows are computed from the blocks by the kernels, more rows by
# dequantizing the matrix and one torch product: about where the two took the same time on 2 threads of AMD EPYCs.
# Multiplied in fp32 (AVX2, 2048 x 2048; dequantizing took 1.5-2.7 ms, the kernels 0.10-0.23 ms a row): Q4_K and Q6_K
# at 48-64 rows, Q8_0 at 24. Multiplied in bf16 where oneDNN does (AVX-512 bf16; 2048 x 2048, 512 x 2048 and
# 2048 x 512): Q4_K at 12-16 rows, Q6_K at 32-48, Q8_0 at 16-24.
KERNEL_ROWS = {Q4_K: 48, Q6_K: 48, Q8_0: 16}  # the other types: 1
KERNEL_ROWS_BESIDE_BF16 = {Q4_K: 12, Q6_K: 32, Q8_0: 16}
IN_ORDER = np.zeros(0, np.int64)  # gguf_numba.coded_product's `order` for inputs as given


def kernel_rows(type_id: int, x: torch.Tensor, exact: bool) -> int:
    """Products of up to this many rows of x are the kernels' (blocks_product): a coded type's KERNEL_ROWS, or
    KERNEL_ROWS_BESIDE_BF16 where more rows would be multiplied in bf16 (cpu_linear.many_rows_weight_dtype), unless
    `exact`, else one (the fp32 kernel decodes each block for each row)."""
    if exact:
        return 1
    table = KERNEL_ROWS_BESIDE_BF16 if many_rows_weight_dtype(x) == torch.bfloat16 else KERNEL_ROWS
    return table.get(type_id, 1)


def block_type(type_id: int) -> tuple[str, int, int]:
    """(name, weights a block, bytes a block) of a computed type, or CheckpointError naming the type."""
    if type_id not in BLOCK_TYPES:
        names = ", ".join(name for name, _, _ in BLOCK_TYPES.values())
        raise CheckpointError(f"GGUF block type id {type_id} is not one computed from its blocks (these are: {names}). "
                              "Use a GGUF file quantized in one of these types.")
    return BLOCK_TYPES[type_id]


def row_bytes(type_id: int, cols: int) -> int:
    """The bytes of one row of `cols` weights in the type."""
    name, elems, nbytes = block_type(type_id)
    if cols <= 0 or cols % elems:
        raise CheckpointError(f"a {name} row holds whole blocks of {elems} weights; {cols} columns are not. "
                              "The GGUF file is corrupt: download it again.")
    return cols // elems * nbytes


def check_blocks(type_id: int, blocks: np.ndarray, cols: int) -> None:
    """CheckpointError unless blocks is a C-contiguous uint8 [rows, row_bytes] matrix of `cols` columns."""
    wanted = row_bytes(type_id, cols)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != wanted or not blocks.flags.c_contiguous:
        raise CheckpointError(f"{BLOCK_TYPES[type_id][0]} blocks of {cols} columns are a C-contiguous uint8 array "
                              f"[rows, {wanted}]; got {blocks.dtype} {list(blocks.shape)}. Pass the tensor's bytes "
                              "as read from the GGUF file, one row of blocks per matrix row.")


def kernels() -> ModuleType | None:
    """gguf_numba.py when it is used (see the module docstring), else None."""
    return compiled_kernels() if numba_allowed() else None


@cache
def compiled_kernels() -> ModuleType | None:
    """gguf_numba.py compiled and checked against gguf-py on one small matrix per type, or None (with a warning)."""
    def load() -> ModuleType:
        from . import gguf_numba
        return gguf_numba
    return checked_module(load, check_kernels, "the GGUF block kernels",
                          "gguf-py's dequantization and torch's products")


def check_kernels(gguf_numba: ModuleType) -> None:
    """Every type's kernels on two rows of two blocks of fixed random bytes (their fp16 scales made finite and small)
    dequantize as gguf-py does, and multiply one activation row within fp32 rounding."""
    generator = np.random.default_rng(0)
    x = generator.standard_normal((1, 512), dtype=np.float32)
    for type_id, (_, elems, _) in BLOCK_TYPES.items():
        cols = 2 * elems
        blocks = random_blocks(type_id, 2, cols, generator)
        want = reference_dequantize(type_id, blocks, cols)
        got = np.empty((2, cols), dtype=np.float32)
        gguf_numba.dequantize_rows(type_id, blocks, got)
        if not np.array_equal(got, want):
            raise ValueError(f"{BLOCK_TYPES[type_id][0]} blocks dequantize differently from gguf-py")
        reference = x[:, :cols].astype(np.float64) @ want.T.astype(np.float64)
        for exact in (True, False):
            product = np.empty((1, 2), dtype=np.float32)
            numba_product(gguf_numba, type_id, blocks, np.ascontiguousarray(x[:, :cols]), product, exact)
            if not np.all(np.abs(product - reference) <= product_bound(type_id, x[:, :cols], want, exact)):
                raise ValueError(f"the product of {BLOCK_TYPES[type_id][0]} blocks differs from the reference")


def product_bound(type_id: int, x: np.ndarray, weights: np.ndarray, exact: bool) -> np.ndarray:
    """How far blocks_product of rows x [T, cols] with a matrix's weights [rows, cols] may be from the exact product
    ([T, rows]): fp32 rounding of the sums (1e-5 of the sum of the products' magnitudes), and unless `exact`, for
    CODED_TYPES the activations' int8 codes (each input off by at most half a step: 1/254 of the largest |x| of its
    group of 32)."""
    x, weights = np.abs(x).astype(np.float64), np.abs(weights).astype(np.float64)
    bound = 1e-5 * (x @ weights.T)
    if type_id in (Q4_K, Q6_K, Q8_0) and not exact:
        largest = x.reshape(x.shape[0], -1, 32).max(axis=2)
        bound += np.repeat(largest / 254, 32, axis=1) @ weights.T
    return bound


def random_blocks(type_id: int, rows: int, cols: int, generator: np.random.Generator) -> np.ndarray:
    """Valid blocks of random contents: random bytes with every fp16 scale field (d, and dmin where there is one) a
    finite value in [-1, 1) / 64, for tests and benchmarks of types gguf-py cannot quantize."""
    _, elems, nbytes = block_type(type_id)
    blocks = generator.integers(0, 256, (rows, cols // elems, nbytes), dtype=np.uint8)
    for at in half_fields(type_id):
        halves = (generator.uniform(-1, 1, (rows, cols // elems)) / 64).astype(np.float16)
        blocks[:, :, at:at + 2] = halves.view(np.uint8).reshape(rows, cols // elems, 2)
    return blocks.reshape(rows, -1)


def half_fields(type_id: int) -> tuple[int, ...]:
    """The byte offsets of a block's fp16 fields (its scale d, and its minimum's scale where there is one)."""
    return {Q2_K: (80, 82), Q3_K: (108,), Q6_K: (208,), Q4_1: (0, 2), Q5_1: (0, 2), Q4_K: (0, 2),
            Q5_K: (0, 2)}.get(type_id, (0,))


def reference_dequantize(type_id: int, blocks: np.ndarray, cols: int) -> np.ndarray:
    """gguf-py's dequantization (llama.cpp's reference) of blocks [rows, row_bytes]: float32 [rows, cols]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return dequantize(blocks, GGMLQuantizationType(type_id)).reshape(blocks.shape[0], cols)


def dequantize_blocks(type_id: int, blocks: np.ndarray, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights of blocks [rows, row_bytes(type_id, cols)] as [rows, cols] in `dtype`: the fp32 weights rounded
    to it once (bf16 ones by the kernel, as torch rounds them)."""
    check_blocks(type_id, blocks, cols)
    compiled = kernels()
    if compiled is None:
        return torch.from_numpy(reference_dequantize(type_id, blocks, cols)).to(dtype)
    bf16 = dtype == torch.bfloat16
    out = torch.empty((blocks.shape[0], cols), dtype=torch.bfloat16 if bf16 else torch.float32)
    with LOCK:
        set_threads()
        if bf16:
            compiled.dequantize_rows_bf16(type_id, blocks, out.view(torch.int16).numpy())
        else:
            compiled.dequantize_rows(type_id, blocks, out.numpy())
    return out.to(dtype)


def blocks_product(type_id: int, blocks: np.ndarray, x: torch.Tensor, exact: bool) -> torch.Tensor:
    """x @ W.T for the matrix W of blocks [rows, row_bytes] and activations x [T, cols] (fp32, bf16 or fp16), in x's
    dtype. `exact` (activations of an fp32 model, the reference mode): W's exact weights times x, summed in fp32; else
    (bf16 or fp16 models) CODED_TYPES' products of up to kernel_rows rows code x as int8 (product_bound). Many rows
    (or no numba) dequantize W for one torch product (cpu_linear.many_rows_product): in bf16 where x is bf16 and
    oneDNN multiplies bf16 (2.4x its fp32 product on an AVX-512 bf16 EPYC), else in fp32 from the exact weights (a
    bf16 product without AVX-512 is many times slower)."""
    if not x.is_floating_point() or x.dtype == torch.float64 or x.ndim != 2:
        raise ValueError(f"activations multiplied with GGUF blocks are float32, bf16 or fp16 [T, cols]; got "
                         f"{x.dtype} {list(x.shape)}. Convert them with .float() first.")
    cols = x.shape[1]
    check_blocks(type_id, blocks, cols)
    compiled = kernels()
    if compiled is None or x.shape[0] > kernel_rows(type_id, x, exact):
        return many_rows_product(x, dequantize_blocks(type_id, blocks, cols, many_rows_weight_dtype(x)))
    out = np.empty((x.shape[0], blocks.shape[0]), dtype=np.float32)
    with LOCK:
        set_threads()
        numba_product(compiled, type_id, blocks, x.detach().float().contiguous().numpy(), out, exact)
    return torch.from_numpy(out).to(x.dtype)


def numba_product(gguf_numba: ModuleType, type_id: int, blocks: np.ndarray, x: np.ndarray, out: np.ndarray,
                  exact: bool) -> None:
    """out = x @ W.T by the kernels: in integers for gguf_numba.CODED_TYPES unless `exact` (x coded as int8,
    product_bound), else in fp32 from the exact weights."""
    if type_id in gguf_numba.CODED_TYPES and not exact:
        gguf_numba.coded_product(type_id, blocks, x, IN_ORDER, out)
    else:
        gguf_numba.product_rows(type_id, blocks, x, out)


class BlocksRows:
    """A matrix of one block type's products of a few rows in one kernel call each (a QuantizedLinear's rows_kernel,
    formats/dense.py), its blocks read where they are held: the activations are reordered (`order`: the inputs'
    order the matrix's columns were stored in, or None) and coded in the call, so the product costs one torch
    conversion besides it. `matrix` is the same matrix as the fused decoding steps read it, with the LoRA side path
    `side` (arrays.Matrix's side_a, side_b; this kernel's own products are the module's, whose side path its owner
    adds). `fmt`: the weight format (formats/table.py) of the module it computes."""

    def __init__(self, fmt: str, compiled: ModuleType, type_id: int, blocks: np.ndarray, order: torch.Tensor | None,
                 side: tuple[np.ndarray, ...] = ()):
        self.fmt, self.compiled, self.type_id, self.blocks, self.side = fmt, compiled, type_id, blocks, side
        self.order = IN_ORDER if order is None else order.numpy().astype(np.int64)

    @classmethod
    def of(cls, fmt: str, type_id: int, blocks: np.ndarray, order: torch.Tensor | None,
           side: tuple[np.ndarray, ...] = ()) -> BlocksRows | None:
        """The kernel of a matrix whose type the kernels multiply in integers, where they are used; else None."""
        return cls(fmt, kernels(), type_id, blocks, order, side) if coded((type_id,)) else None

    @property
    def matrix(self) -> BlockMatrix:
        return BlockMatrix(self.type_id, self.blocks, self.order, *self.side)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel computes this product (it is attached to bf16 and fp16 models only: it codes x)."""
        return x.numel() <= kernel_rows(self.type_id, x, False) * x.shape[-1] and plain_cpu(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.detach().reshape(-1, x.shape[-1]).float().contiguous().numpy()
        out = np.empty((rows.shape[0], self.blocks.shape[0]), np.float32)
        with LOCK:
            set_threads()
            self.compiled.coded_product(self.type_id, self.blocks, rows, self.order, out)
        return torch.from_numpy(out).to(x.dtype).reshape(*x.shape[:-1], -1)


def coded(types: tuple[int, ...]) -> bool:
    """Whether the kernels are used and multiply each of `types` in integers (gguf_numba.CODED_TYPES)."""
    compiled = kernels()
    return compiled is not None and all(t in compiled.CODED_TYPES for t in types)


def computes_step(types: tuple[int, int, int], x: torch.Tensor) -> bool:
    """Whether routed_step computes the decoding rows x of experts whose gate, up and down rows are of `types`: they
    are coded, x is not fp32 (whose products are blocks_product's exact ones), and there are at most FEW_ROWS rows."""
    return x.shape[0] <= FEW_ROWS and x.dtype != torch.float32 and coded(types)


def routed_step(types: tuple[int, int, int], row_bytes: tuple[int, int, int], inter: int, gate_up: np.ndarray,
                down: np.ndarray, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum for the decoding rows x [T, H] (ids, weights [T, k]) in one kernel call,
    for experts whose gate, up and down rows are of `types` (see gguf_numba.coded_routed_step), where the kernels
    are computed (computes_step)."""
    compiled = kernels()
    out = np.empty(tuple(x.shape), np.float32)
    with LOCK:
        set_threads()
        compiled.coded_routed_step(np.array(types, np.int64), np.array(row_bytes, np.int64), inter, gate_up, down,
                                   x.detach().float().contiguous().numpy(), ids.contiguous().numpy(),
                                   weights.detach().float().contiguous().numpy(), out)
    return torch.from_numpy(out).to(x.dtype)
