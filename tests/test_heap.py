"""heap_kept, opted in (A3B_KEEP_HEAP=1): freed tensor memory stays in the process for reuse inside and goes back to
the kernel at the end, so RSS after a generation is what it was before."""
from __future__ import annotations

import resource

import pytest
import torch

from a3b_core.runtime.glibc_heap import _glibc, heap_kept

pytestmark = pytest.mark.skipif(_glibc() is None, reason="glibc heap tuning only")
MiB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


# a layer's temporaries; a long prompt's, above glibc's own 32 MiB mmap threshold
@pytest.mark.parametrize("size", [16 * MiB, 64 * MiB])
def test_freed_memory_is_kept_inside_and_handed_back_after(monkeypatch, size):
    monkeypatch.setenv("A3B_KEEP_HEAP", "1")
    _glibc().malloc_trim(0)  # free memory earlier tests left in the heap would serve the allocation below
    before = rss()
    with heap_kept():
        torch.ones(size // 4)  # allocated, touched and freed
        retained = rss()
    assert retained - before > size * 3 // 4
    assert rss() - before < 4 * MiB
