"""What the numba kernels read, without numba: the code by which a kernel knows a stack's weight layout (the layouts
are described in cpu_numba.py's docstring) and a matrix's bundle of that code and its arrays."""
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


def plain_cpu(*tensors: torch.Tensor) -> bool:
    """True when every tensor is an ordinary CPU tensor, whose data numpy reads (not a fake or other subclass)."""
    return all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors)
