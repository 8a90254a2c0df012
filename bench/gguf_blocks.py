"""One activation row times a GGUF block-quantized matrix on the CPU: the numba kernel reading the blocks
(kernels/gguf_blocks.py blocks_product, the activation's coding and the call included) against torch's bf16
matrix-vector product of the same matrix dequantized (torch.nn.functional.linear), in GB/s of the bytes each reads,
and the ratio of their times.

    python bench/gguf_blocks.py                      # every computed type, 2048 x 2048, 2 threads
    python bench/gguf_blocks.py --types Q4_K Q8_0 --threads 1

Matrices are random valid blocks (kernels/gguf_blocks.py random_blocks); reading them costs the same as real ones.
Rounds interleave the two products; medians are printed. The matrices (4-9 MiB of blocks, 8 MiB of bf16) may sit
partly in a large L3 cache: these are compute rates more than memory-bound ones.

An AMD EPYC (AVX2, 2 vCPUs), 2 threads, 2048 x 2048, one row (median of 200 calls each); Q4_K, Q6_K and Q8_0 are
multiplied in integers, the row coded as int8 (kernels/gguf_vector.py), the others decoded to fp32:

    type     kernel us  GB/s  bf16 us  GB/s  bf16/kernel time
    Q4_0       5745     0.41    475    17.7   0.08
    Q4_1       6493     0.40    478    17.6   0.07
    Q5_0       5105     0.56    511    16.4   0.10
    Q5_1       5355     0.59    443    18.9   0.08
    Q8_0        219    20.31    437    19.2   1.99
    Q2_K       4859     0.28    447    18.8   0.09
    Q3_K       6850     0.26    454    18.5   0.07
    Q4_K        181    13.03    444    18.9   2.45
    Q5_K       3935     0.73    433    19.4   0.11
    Q6_K        155    22.21    409    20.5   2.64
    IQ4_NL     5116     0.46    442    19.0   0.09
    IQ4_XS     4954     0.45    440    19.1   0.09

The machine's speed swings between runs (Q4_K read 13-18 GB/s in three runs the same hour); on 8192 x 2048
matrices, in one process alternating with the int16-coded kernels they replaced, Q4_K read 20-22 against 14 GB/s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: a3b_core

from bench.machine import cpu_description  # noqa: E402
from a3b_core.kernels.gguf_blocks import blocks_product, compiled_kernels, dequantize_blocks, random_blocks  # noqa: E402
from a3b_core.kernels.gguf_types import BLOCK_TYPES  # noqa: E402


def timed(run, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", default=[name for name, _, _ in BLOCK_TYPES.values()])
    parser.add_argument("--size", type=int, default=2048, help="rows and columns of the matrix")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    kernels = compiled_kernels()
    if kernels is None:
        sys.exit("numba's GGUF kernels are not available here")
    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    print(f"{cpu_description()}, {args.threads} threads, {args.size} x {args.size}, T = 1")
    print(f"{'type':8} {'kernel us':>10} {'GB/s':>6} {'bf16 us':>9} {'GB/s':>6} {'bf16/kernel time':>17}")
    ids = {name: type_id for type_id, (name, _, _) in BLOCK_TYPES.items()}
    generator = np.random.default_rng(0)
    for name in args.types:
        type_id = ids[name]
        blocks = random_blocks(type_id, args.size, args.size, generator)
        weight = dequantize_blocks(type_id, blocks, args.size).bfloat16()
        x = torch.from_numpy(np.random.default_rng(1).standard_normal((1, args.size), dtype=np.float32))
        x_bf16 = x.bfloat16()
        kernel_times, torch_times = [], []
        for _ in range(args.rounds // 20):  # interleaved rounds of 20 calls each
            kernel_times += timed(lambda: blocks_product(type_id, blocks, x, exact=False), 20)
            torch_times += timed(lambda: F.linear(x_bf16, weight), 20)
        kernel_s, torch_s = statistics.median(kernel_times), statistics.median(torch_times)
        print(f"{name:8} {kernel_s * 1e6:10.1f} {blocks.nbytes / kernel_s / 1e9:6.2f} {torch_s * 1e6:9.1f} "
              f"{weight.nelement() * 2 / torch_s / 1e9:6.2f} {torch_s / kernel_s:17.2f}", flush=True)


if __name__ == "__main__":
    main()
