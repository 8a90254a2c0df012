"""What writing a quantized matrix's prefill weights in bf16 is worth: one loaded bench model prefills the same prompt
with the dequantizing kernel writing bf16 weights (what loading does where oneDNN multiplies bf16) and writing fp32
weights that torch's product then converts, in interleaved rounds; medians of seconds per prefill, and each as a
multiple of the fp32 weights' time.

    python bench/prefill_weights.py                          # int8 experts, dense int8
    python bench/prefill_weights.py --experts int4 --dense-format int4

The choice is the module-level function kernel_stores.dequantized_product asks (cpu_linear.many_rows_weight_dtype),
swapped between rounds; on a CPU without bf16 matrix kernels both variants are fp32 and the same.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: bench.*, a3b_core

from a3b_core.formats import kernel_stores
from a3b_core.kernels import cpu_linear as products
from bench.decode_kernels import load_bench_model, print_medians, timed_rounds, variants_parser  # noqa: E402
from bench.worker import prompt_ids  # noqa: E402

VARIANTS = {"bf16 weights": products.many_rows_weight_dtype, "fp32 weights": lambda x: torch.float32}


def main() -> None:
    parser = variants_parser(__doc__.splitlines()[0], rounds=5)
    parser.add_argument("--prefill", type=int, default=128, help="prompt tokens")
    args = parser.parse_args()
    model = load_bench_model(args)
    prompt = prompt_ids(args.prefill, model.config.text.vocab_size)
    model.generate(prompt[:16], max_new_tokens=1, temperature=0)  # warm-up

    def prepare(variant: str) -> None:
        kernel_stores.many_rows_weight_dtype = VARIANTS[variant]

    times = timed_rounds(list(VARIANTS), args.rounds, prepare,
                         lambda: model.generate(prompt, max_new_tokens=1, temperature=0))
    print(f"experts {args.experts}, dense {args.dense_format}, {args.threads} threads, {args.prefill}-token prefill, "
          f"{args.rounds} rounds (medians)")
    print_medians(times, "dequantized weights", "s per prefill", "fp32 weights")


if __name__ == "__main__":
    main()
