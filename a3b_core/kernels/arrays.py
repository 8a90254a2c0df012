"""What the numba kernels read, without numba: the code by which a kernel knows a stack's weight layout (the layouts
are described in cpu_numba.py's docstring), a matrix's bundle of that code and its arrays, a GGUF matrix's bundle of
its blocks (gguf_numba.py), and a layer's routed experts as a decoding step reads them in either layout."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

INT8, FP8, BF16, INT4 = 0, 1, 2, 3
NO_SIDE_PATH = np.zeros((0, 0), np.float32)


class Matrix(NamedTuple):
    """A matrix (or stack of experts' matrices) as the kernels read it: its format code and its arrays (q, scale), as
    kernels built from cpu_numba.py's products take it (numba reads NamedTuples in nopython mode). A dense matrix may
    carry a LoRA side path added to its product: side_a [R, in] and side_b [out, R] (fp32 holding bf16 values, the
    scales in side_b); R = 0: none."""
    code: int
    q: np.ndarray
    scale: np.ndarray
    side_a: np.ndarray = NO_SIDE_PATH
    side_b: np.ndarray = NO_SIDE_PATH


class BlockMatrix(NamedTuple):
    """A dense matrix in a GGUF file's blocks as the fused steps read it: its block type (one of
    gguf_numba.CODED_TYPES), its blocks uint8 [out, row_bytes], the order its product reads its inputs in (int64 [in];
    empty: as given) and a LoRA side path as Matrix's."""
    type_id: int
    q: np.ndarray
    order: np.ndarray
    side_a: np.ndarray = NO_SIDE_PATH
    side_b: np.ndarray = NO_SIDE_PATH


class RoutedExperts(NamedTuple):
    """A layer's routed experts as cpu_numba.routed_step reads them: each expert's fused gate and up rows, then its
    down rows (one format), and the intermediate size."""
    gate_up: Matrix
    down: Matrix
    inter: int


class BlockExperts(NamedTuple):
    """A layer's routed experts in a GGUF file's blocks as gguf_numba.coded_routed_step reads them: the gate rows', up
    rows' and down rows' block types and bytes per row (int64 [3] each), the blocks of each expert's gate and up rows
    (uint8 [E, bytes]) and of its down rows, and the intermediate size."""
    types: np.ndarray
    row_bytes: np.ndarray
    gate_up: np.ndarray
    down: np.ndarray
    inter: int


def plain_cpu(*tensors: torch.Tensor) -> bool:
    """True when every tensor is an ordinary CPU tensor, whose data numpy reads (not a fake or other subclass)."""
    return all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
