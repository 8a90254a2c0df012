"""What writing a quantised matrix's prefill weights in bf16 is worth: one loaded bench model prefills the same prompt
with the dequantising kernel writing bf16 weights (what loading does where oneDNN multiplies bf16) and writing fp32
weights that torch's product then converts, in interleaved rounds; medians of seconds per prefill.

    python bench/prefill_weights.py                          # int8 experts, dense int8
    python bench/prefill_weights.py --experts int4 --dense-format int4

The choice is the module-level function both callers of the dequantising kernel ask (products.many_rows_weight_dtype),
swapped between rounds; on a CPU without bf16 matrix kernels both variants are fp32 and the same.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: bench.*, a3b_core

from a3b_core import load_model  # noqa: E402
from a3b_core.backends import kernel_experts, kernel_steps, products  # noqa: E402
from bench.bench_model import bench_dir, bench_model_dir  # noqa: E402
from bench.worker import prompt_ids  # noqa: E402

VARIANTS = {"bf16 weights": products.many_rows_weight_dtype, "fp32 weights": lambda x: torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", default="int8", help="weight_format of the routed experts")
    parser.add_argument("--dense-format", default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill", type=int, default=128, help="prompt tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("A3B_CACHE_DIR", str(bench_dir() / "a3b-cache"))  # speed.py's converted experts
    model = load_model(bench_model_dir(), preset="cpu", compute_dtype="bfloat16", weight_format=args.experts,
                       dense_format=args.dense_format)
    prompt = prompt_ids(args.prefill, model.config.text.vocab_size)
    model.generate(prompt[:16], max_new_tokens=1, temperature=0)  # warm-up
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant, weight_dtype in VARIANTS.items():
            kernel_experts.many_rows_weight_dtype = kernel_steps.many_rows_weight_dtype = weight_dtype
            started = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, temperature=0)
            times[variant].append(time.perf_counter() - started)
    print(f"experts {args.experts}, dense {args.dense_format}, {args.threads} threads, {args.prefill}-token prefill, "
          f"{args.rounds} rounds (medians)")
    print("| dequantised weights | s per prefill | vs fp32 |")
    print("|---|---|---|")
    base = statistics.median(times["fp32 weights"])
    for variant in VARIANTS:
        seconds = statistics.median(times[variant])
        print(f"| {variant} | {seconds:.2f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
