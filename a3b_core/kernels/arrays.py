"""What the numba kernels read, without numba: the code by which a kernel knows a stack's weight layout (the layouts
are described in cpu_numba.py's docstring)."""
from __future__ import annotations

INT8, FP8, BF16, INT4 = 0, 1, 2, 3
