"""The C heap kept for reuse while a generation runs: an opt-in (A3B_KEEP_HEAP=1), Linux with glibc only.

torch allocates CPU tensors with malloc. By default glibc gives large freed blocks back to the kernel, so each layer
of a long prefill maps, zeroes and faults in fresh pages for temporaries of the sizes the last layer just freed: on
an AVX-512 EPYC with 2 threads, a fifth or more of a 512-token bf16 prefill. Opted in, freed memory stays in the heap
while a generation runs and is reused; when it ends, the free memory goes back to the kernel, so RSS between
generations is what it was. It is off by default because malloc's settings are process-wide: inside ComfyUI every
other node would see them, and setting the mmap threshold ends glibc's adaptive one for the rest of the process.
"""
from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
KEEP_BYTES = 1 << 30  # free memory at the heap's top kept while generating
# Blocks above this get their own mapping while generating. A 4096-token prompt's activations of 2048 fp32 channels
# are 32 MiB each: mapped afresh each time (glibc's own threshold tops out at 32 MiB), they cost the bench model's
# Q4_K_M 4096-token prefill 4-7% (2 threads, AVX-512 EPYC, separate processes, alternating).
KEPT_MMAP_BYTES = 512 << 20
# The threshold after a generation: setting it ends glibc's adaptive one for the process, so it goes back to where
# the adaptive one tops out.
MMAP_BYTES = 32 << 20
DEFAULT_TRIM_BYTES = 128 << 10  # glibc's default trim threshold


@cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@contextmanager
def heap_kept() -> Iterator[None]:
    """With A3B_KEEP_HEAP=1, freed memory is reused inside the block and handed back to the kernel at its end."""
    libc = _glibc() if os.environ.get("A3B_KEEP_HEAP") == "1" else None
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, KEPT_MMAP_BYTES)
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_BYTES)
        libc.malloc_trim(0)
