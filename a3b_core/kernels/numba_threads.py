"""What numba's kernel modules (cpu_numba.py, gguf_numba.py) share: the switch that turns them off (A3B_NO_NUMBA=1),
how a module is compiled and checked before use, the disk cache's stamp of kernels made of other files' code, one
lock and one thread count."""
from __future__ import annotations

import hashlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
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


def numba_allowed() -> bool:
    """False when the environment sets A3B_NO_NUMBA=1: the kernels are not even compiled."""
    return os.environ.get("A3B_NO_NUMBA", "0") in ("", "0")


def checked_module(load: Callable[[], ModuleType], check: Callable[[ModuleType], None], kernels: str,
                   fallback: str) -> ModuleType | None:
    """The kernel module `load` imports, once `check` passed on it (compiling its kernels); None when numba is not
    installed, or, with a warning naming the `kernels` and the `fallback` used instead, when they fail."""
    try:
        module = load()
    except ImportError:
        return None
    try:
        check(module)
    except Exception as exc:  # numba's compile errors have many types; any failure means the fallback
        warnings.warn(f"a3b_core: numba could not compile {kernels} ({exc}); using {fallback}. Set A3B_NO_NUMBA=1 "
                      "to skip the attempt.", stacklevel=3)
        return None
    return module


def key_cache_on(kernels: Iterable[object], *sources: str) -> None:
    """Adds a hash of the `sources` files' text to the disk cache stamp of each numba kernel (numba stamps a
    function's own file only), so that once a file whose code they compile in changes (an update of the pack), they
    are compiled again instead of loading copies of the old code. The stamp lives in numba's private cache object; a
    numba without it keeps its own stamp."""
    digest = hashlib.sha256(b"".join(Path(source).read_bytes() for source in sources)).hexdigest()
    for kernel in kernels:
        cache_file = getattr(getattr(kernel, "_cache", None), "_cache_file", None)
        if hasattr(cache_file, "_source_stamp"):
            cache_file._source_stamp = (cache_file._source_stamp, digest)
