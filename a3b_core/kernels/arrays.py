"""What the numba kernels read, without numba: the code by which a kernel knows a stack's weight layout (the layouts
are described in cpu_numba.py's docstring) and a matrix's bundle of that code and its arrays."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

INT8, FP8, BF16, INT4 = 0, 1, 2, 3


class Matrix(NamedTuple):
    """A matrix (or stack of experts' matrices) as the kernels read it: its format code and its arrays (q, scale), as
    kernels built from cpu_numba.py's products take it (numba reads NamedTuples in nopython mode)."""
    code: int
    q: np.ndarray
    scale: np.ndarray
