"""The one lock and thread count of numba's kernels (cpu_numba.py, gguf_numba.py), shared by every caller."""
from __future__ import annotations

import threading
import torch

LOCK = threading.Lock()  # numba's thread pools do not all accept calls from two threads at once
# the kernels' thread count as last set on this thread (numba's setting is per thread; setting it costs ~17 us)
_threads = threading.local()


def set_threads() -> None:
    """Gives numba's kernels torch's thread count (call under LOCK; numba's pool holds at most NUMBA_NUM_THREADS)."""
    threads = torch.get_num_threads()
    if threads != getattr(_threads, "count", 0):
        import numba  # imported by the kernels' modules already: the engine imports numba only where they run
        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
        _threads.count = threads
