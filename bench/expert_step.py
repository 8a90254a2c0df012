"""One layer's routed-expert step on the CPU: torch's per-expert products vs the numba kernel
(formats/kernel_stores.py).

    python bench/expert_step.py                       # int8, int4, FP8 and bf16, 1 row, 2 threads
    python bench/expert_step.py --rows 4 --formats int8

The bench model's shapes (hidden 1024, moe_intermediate 512, 64 experts, top-8) with 16 layers of random weights in
their own memory (copies of one layer: far more than the L3 cache holds), each step a random routing on the next layer,
run through the model's own RoutedExperts.routed_experts with the store as loading makes it without numba (torch; int4
in torch's packing) and with its KernelExperts swap (numba). Rounds interleave the two; each format's medians are
printed as soon as it is done, with the weight bytes a step reads per second (the experts its rows pick between them, in
expectation), next to the memory bandwidth measured in the same run (roofline.py: 1 GiB fp32 sum).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: bench.*, a3b_core

from a3b_core.formats.kernel_stores import KernelExperts, compiled_kernels
from a3b_core.formats.stores import CpuFloatExperts, QuantizedExperts
from a3b_core.models.layers import RoutedExperts  # noqa: E402
from a3b_core.runtime.cpu_swaps import repack_int4_for_torch
from bench.roofline import measure_bandwidth  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 1024, 512, 64, 8, 16


def random_store(fmt: str, g: torch.Generator) -> QuantizedExperts | CpuFloatExperts:
    """A layer's experts in `fmt` with random contents; bf16 as loading places float experts on the CPU. int8 and int4
    are random valid codes and scales (quantizing real matrices would take minutes and read no differently). FP8 is
    random matrices quantized as the released checkpoints are (128x128 blocks, the largest code near 448): uniform
    random bytes would make 1 code in 16 subnormal, against about 1 in 10,000 in a real checkpoint, and subnormal
    weights take microcode assists on Intel CPUs."""
    if fmt == "bf16":
        return CpuFloatExperts(*(torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16() * 0.02)
                                 for shape in ((EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER))))
    store = QuantizedExperts(fmt, EXPERTS, HIDDEN, INTER)
    for stack in (store.gate_up_proj, store.down_proj):
        if fmt == "fp8":
            for e in range(EXPERTS):
                stack.set(e, torch.randn(stack.shape[1:], generator=g) * 0.02)
            continue
        raw = torch.randint(0, 256, stack.q.shape, generator=g, dtype=torch.uint8)
        stack.q.copy_(raw.view(stack.q.dtype))
        stack.scale.copy_(torch.rand(stack.scale.shape, generator=g) * 0.01)
    return store


def store_bytes(store: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*store.parameters(), *store.buffers()])


def time_steps(layers: list[RoutedExperts], rows: int, steps: int, g: torch.Generator) -> float:
    """Seconds per layer-step, stepping through the layers with random routings."""
    inputs = []
    for _ in range(steps):
        x = torch.randn(rows, HIDDEN, generator=g).bfloat16()
        top_i = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(rows)])
        top_p = torch.softmax(torch.randn(rows, TOP_K, generator=g), -1).bfloat16()
        inputs.append((x, top_i, top_p))
    started = time.perf_counter()
    for step, (x, top_i, top_p) in enumerate(inputs):
        layers[step % len(layers)].routed_experts(x, top_i, top_p, decoding=True)
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="int8,int4,fp8,bf16")
    parser.add_argument("--rows", type=int, default=1, help="rows per step: sequences decoded together")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=64, help="layer-steps per round and path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = compiled_kernels()
    if kernels is None:
        sys.exit("numba is not installed or cannot compile the kernels")
    g = torch.Generator().manual_seed(0)
    cfg = SimpleNamespace(hidden_size=HIDDEN, num_experts=EXPERTS, moe_intermediate_size=INTER,
                          num_experts_per_tok=TOP_K)
    bandwidth = measure_bandwidth(args.threads)
    print(f"{args.rows} row(s) per step, {args.threads} threads, hidden {HIDDEN}, moe_intermediate {INTER}, "
          f"{EXPERTS} experts top-{TOP_K}, {LAYERS} layers; medians of {args.rounds} rounds")
    print("| format | torch ms | torch GB/s | numba ms | numba GB/s | numba vs torch | bandwidth GB/s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for fmt in args.formats.split(","):
        first = random_store(fmt, g)
        stores = [first] + [copy.deepcopy(first) for _ in range(LAYERS - 1)]
        # the experts a step reads: each row picks TOP_K of EXPERTS at random, so rows share some (expected count)
        step_bytes = store_bytes(first) * (1 - (1 - TOP_K / EXPERTS) ** args.rows)
        with torch.device("meta"):
            torch_layers = [RoutedExperts(cfg) for _ in stores]
            kernel_layers = [RoutedExperts(cfg) for _ in stores]
        for torch_layer, kernel_layer, store in zip(torch_layers, kernel_layers, stores):
            kernel_layer.experts = KernelExperts(store, kernels)
            torch_layer.experts = copy.deepcopy(store) if fmt == "int4" else store
            repack_int4_for_torch(torch_layer.experts)
        del first, stores
        time_steps(torch_layers, args.rows, LAYERS, g)  # warm-up: page faults, first calls
        time_steps(kernel_layers, args.rows, LAYERS, g)
        timings: dict[str, list[float]] = {"torch": [], "numba": []}
        for _ in range(args.rounds):
            timings["torch"].append(time_steps(torch_layers, args.rows, args.steps, g))
            timings["numba"].append(time_steps(kernel_layers, args.rows, args.steps, g))
        del torch_layers, kernel_layers
        t = {path: statistics.median(times) for path, times in timings.items()}
        print(f"| {fmt} | {t['torch'] * 1e3:.3f} | {step_bytes / t['torch'] / 1e9:.1f} | {t['numba'] * 1e3:.3f} | "
              f"{step_bytes / t['numba'] / 1e9:.1f} | {t['torch'] / t['numba']:.2f}x | {bandwidth / 1e9:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
