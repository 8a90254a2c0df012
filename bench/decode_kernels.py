"""What each group of decoding kernels (runtime/step_kernels.py) is worth: one loaded bench model decodes with all
of them, then with one group detached at a time, then with none, in interleaved rounds; medians of ms per token.

    python bench/decode_kernels.py                           # bf16 compute, int8 experts, dense int8
    python bench/decode_kernels.py --experts bf16 --dense-format auto

Groups: "layer step" (a decoder layer's whole step in one call), "int8 dense" (QuantizedLinear products), "bf16
dense" (large bf16 CpuLinear / FusedLinear products), "deltanet" (the Gated DeltaNet step), "moe step" (a MoE block's
whole step), "norms" (RMSNorms of bf16 rows). A layer step is made of the other groups' kernels, so every variant but
"all" detaches it: "without layer step" is the layers' path with the separate kernels, "without norms" that path
without the norms' kernels. The routed experts' kernel stays in every variant (bench/expert_step.py measures it). One
process and one model for every variant, so only the detached kernels differ between them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: bench.*, a3b_core

from a3b_core import load_model  # noqa: E402
from a3b_core.formats.kernel_stores import FORMAT_CODES
from bench.bench_model import bench_dir, bench_model_dir  # noqa: E402

GROUPS = ("layer step", "int8 dense", "bf16 dense", "deltanet", "moe step", "norms")


def kernel_group(module: torch.nn.Module) -> tuple[str, str] | None:
    """(group, attribute) of a module's attached kernel, or None."""
    if getattr(module, "norm_kernel", None) is not None:
        return "norms", "norm_kernel"
    if getattr(module, "step_kernel", None) is not None:
        kind = "layer step" if hasattr(module, "mlp") else "moe step" if hasattr(module, "experts") else "deltanet"
        return kind, "step_kernel"
    kernel = getattr(module, "rows_kernel", None)
    if kernel is not None:
        return ("bf16 dense" if kernel.code == FORMAT_CODES["bf16"] else "int8 dense"), "rows_kernel"
    return None


def variants_parser(description: str, rounds: int) -> argparse.ArgumentParser:
    """The options of a bench that times variants in interleaved rounds on one loaded bench model."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--experts", default="int8", help="weight_format of the routed experts")
    parser.add_argument("--dense-format", default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser


def load_bench_model(args: argparse.Namespace):
    """The bench model in bf16 with the options' experts and dense format, torch on their thread count; converted
    experts come from speed.py's cache."""
    torch.set_num_threads(args.threads)
    os.environ.setdefault("A3B_CACHE_DIR", str(bench_dir() / "a3b-cache"))
    return load_model(bench_model_dir(), preset="cpu", compute_dtype="bfloat16", weight_format=args.experts,
                      dense_format=args.dense_format)


def timed_rounds(variants: list[str], rounds: int, prepare: Callable[[str], None],
                 run: Callable[[], object]) -> dict[str, list[float]]:
    """Seconds of each run(), per variant, in `rounds` rounds that interleave the variants, prepare(variant) first."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            prepare(variant)
            started = time.perf_counter()
            run()
            times[variant].append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = variants_parser(__doc__.splitlines()[0], rounds=4)
    parser.add_argument("--decode", type=int, default=32, help="tokens timed per variant and round")
    args = parser.parse_args()
    model = load_bench_model(args)
    attached = [(m, *group, getattr(m, group[1])) for m in model.text.modules() if (group := kernel_group(m))]
    present = [g for g in GROUPS if any(group == g for _, group, _, _ in attached)]
    variants = ["all", *(f"without {g}" for g in present), "none"]

    def detach(variant: str) -> None:
        for module, group, attribute, kernel in attached:
            off = variant in ("none", f"without {group}") or (group == "layer step" and variant != "all")
            setattr(module, attribute, None if off else kernel)

    def prepare(variant: str) -> None:
        detach(variant)
        model.generate(prompt, max_new_tokens=2, temperature=0)  # warm-up

    prompt = torch.tensor([[1, 2, 3]])
    seconds = timed_rounds(variants, args.rounds, prepare,
                           lambda: model.generate(prompt, max_new_tokens=args.decode + 1, temperature=0))
    times = {variant: [s / args.decode * 1e3 for s in runs] for variant, runs in seconds.items()}
    print(f"experts {args.experts}, dense {args.dense_format}, {args.threads} threads, {args.rounds} rounds "
          f"(medians; includes a 3-token prefill per {args.decode} tokens)")
    print_medians(times, "kernels", "ms per token", "all")


def print_medians(times: dict[str, list[float]], label: str, unit: str, base: str) -> None:
    """A markdown table of each variant's median and its time as a multiple of the `base` variant's."""
    print(f"| {label} | {unit} | vs {base} |")
    print("|---|---|---|")
    reference = statistics.median(times[base])
    for variant, runs in times.items():
        median = statistics.median(runs)
        print(f"| {variant} | {median:.2f} | {median / reference:.2f}x |")


if __name__ == "__main__":
    main()
