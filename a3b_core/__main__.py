"""Command line: `python -m a3b_core plan MODEL --preset 8gb [--json]`, `python -m a3b_core inspect MODEL`."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .checkpoint import Checkpoint
from .config import load_config
from .errors import A3BError
from .placement import GiB, KV_CACHES, PRESET_NAMES, WEIGHT_FORMATS, classify, expert_layout, format_bytes, \
    plan_for_folder


def cmd_plan(args: argparse.Namespace) -> int:
    plan = plan_for_folder(args.model, args.preset, weight_format=args.weight_format, kv_cache=args.kv_cache,
                           max_context=args.max_context, has_cuda=True if args.vram is not None else None,
                           gpu_free=None if args.vram is None else int(args.vram * GiB),
                           cpu_free=None if args.ram is None else int(args.ram * GiB))
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    folder = Path(args.model)
    config = load_config(folder)
    ckpt = Checkpoint(folder)
    t, v = config.text, config.vision
    full = t.layer_types.count("full_attention")
    lines = [f"model: {folder}",
             f"config: {config.model_type}, {t.num_layers} layers ({full} full attention, {t.num_layers - full} "
             f"DeltaNet), hidden {t.hidden_size}, vocab {t.vocab_size}, context {t.max_position_embeddings}",
             (f"experts: {t.num_experts} per layer, top-{t.num_experts_per_tok}, size {t.moe_intermediate_size}, "
              f"shared expert {t.shared_expert_intermediate_size}" if t.is_moe
              else f"dense MLP: intermediate size {t.intermediate_size}"),
             f"vision: {v.depth} blocks, hidden {v.hidden_size}" if v else "vision: none"]
    if config.quantization:
        lines.append(f"quantization_config: {json.dumps(config.quantization)}")
    total = sum(info.nbytes for info in ckpt.infos.values())
    lines.append(f"tensors: {len(ckpt.infos)} in {len(ckpt.files)} files, {format_bytes(total)}")
    by_dtype = Counter()
    for info in ckpt.infos.values():
        by_dtype[str(info.dtype).removeprefix("torch.")] += info.nbytes
    lines += [f"  {dtype}: {format_bytes(n)}" for dtype, n in by_dtype.most_common()]
    tensors = {name: (info.shape, info.dtype) for name, info in ckpt.infos.items()}
    lines.append(f"expert layout: {expert_layout(config, tensors)}")
    mtp = sum(1 for name in ckpt.infos if classify(name)[0] == "mtp")
    if mtp:
        lines.append(f"mtp: {mtp} tensors (not loaded)")
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m a3b_core", description="A3B engine tools.")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="show where each part of a model would live (reads headers only)")
    plan.add_argument("model", help="model folder (config.json + .safetensors)")
    plan.add_argument("--preset", default="auto", choices=PRESET_NAMES)
    plan.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                      help="format of the routed experts kept in RAM")
    plan.add_argument("--kv-cache", default="auto", choices=KV_CACHES)
    plan.add_argument("--max-context", type=int, default=None, help="tokens (default: the preset's)")
    plan.add_argument("--ram", type=float, default=None, help="RAM budget in GiB (default: MemAvailable)")
    plan.add_argument("--vram", type=float, default=None,
                      help="free VRAM in GiB (default: this GPU's); given, it plans for a GPU even without CUDA")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(run=cmd_plan)

    inspect = commands.add_parser("inspect", help="summarise a model folder's config and tensors")
    inspect.add_argument("model", help="model folder (config.json + .safetensors)")
    inspect.set_defaults(run=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except A3BError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
