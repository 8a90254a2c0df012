"""The machine a benchmark ran on, for its report: the CPU's model name and the vector and matrix features the
kernels on both sides pick from (a number measured on one CPU says little about another)."""
from __future__ import annotations

import platform
import re
from pathlib import Path

# the features that change which kernels run: AVX2 / AVX-512 widths, bf16 and int8 dot products, AMX tiles, F16C
FEATURES = ("avx2", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16",
            "amx_int8")


def cpu_description() -> str:
    """'MODEL NAME (feature, ...)' from /proc/cpuinfo, or the platform's processor name where there is none."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = re.search(r"model name\s*:\s*(.+)", info)
    flags = re.search(r"^flags\s*:\s*(.+)$", info, re.MULTILINE)
    present = set(flags.group(1).split()) if flags else set()
    features = ", ".join(f for f in FEATURES if f in present) or "none of " + ", ".join(FEATURES)
    return f"{name.group(1).strip() if name else platform.processor() or 'unknown CPU'} ({features})"
