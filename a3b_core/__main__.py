"""Command line: `python -m a3b_core caption IMAGE...`, `caption-folder DIR`, `plan MODEL --preset 8gb [--json]`,
`inspect MODEL`, `serve MODEL [--preset P] [--device D] [--host H] [--port P] [--api-key-env VAR]`; `caption`,
`caption-folder` and `serve` take `--lora PATH[:STRENGTH]`, repeatable; `serve` also `--lora-module
NAME=PATH[:STRENGTH]`. Every command that reads a .gguf model takes `--mmproj auto|none|PATH` (its vision tower)."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .errors import A3BError, AdapterError, ImageError
from .models import family_for
from .release.adapters import adapter_files
from .runtime.gguf_source import model_headers
from .runtime.loader import DEMO_MODEL_NAME, DEMO_MODELS, load_model, resolve_model_path
from .runtime.options import (DENSE_FORMATS, DEVICE_CHOICES, KV_FORMATS, PRESET_NAMES, RESIZE_MODES, WEIGHT_FORMATS,
                              GenerationOptions, LoadOptions, parse_lora)
from .runtime.placement import GiB, format_bytes, plan_for_folder
from .services.caption_folder import (DEFAULT_CAPTION_PROMPT, EXISTING_POLICIES, PRESETS, FolderJob, Shaping, check_job,
                                      phrases, run_to_end, summary)

CAPTION_MAX_NEW_TOKENS = 128  # `caption`: a caption is a sentence or two
THINKING_MAX_NEW_TOKENS = 2048  # ... and the reasoning before it, when the prompt thinks
MODEL_HELP = f"model folder (config.json + .safetensors), or an embedded demo model: {', '.join(DEMO_MODELS)}"
LORA_HELP = ("a LoRA adapter on the model: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) or "
             "its .safetensors file, with an optional strength after the last ':' (default 1.0; 0 = off, negative "
             "inverts); repeat it for several adapters. The base weights are not changed")
MMPROJ_HELP = ("a .gguf model's vision tower (llama.cpp's mmproj-*.gguf): auto (default) the mmproj*.gguf beside the "
               "model file, text only if there is none; none: text only; or the mmproj file's path")


def cmd_plan(args: argparse.Namespace) -> int:
    plan = plan_for_folder(resolve_model_path(args.model), args.preset, mmproj=args.mmproj,
                           weight_format=args.weight_format,
                           dense_format=args.dense_format, kv_cache=args.kv_cache, max_context=args.max_context,
                           has_cuda=True if args.vram is not None else None,
                           gpu_free=None if args.vram is None else int(args.vram * GiB),
                           cpu_free=None if args.ram is None else int(args.ram * GiB))
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan)
    return 0


def check_image_files(paths: Sequence[str]) -> None:
    """Every path must be a file before the first caption, so a typo in the last one costs no work."""
    for path in paths:
        if not Path(path).is_file():
            raise ImageError(f"{path}: no such image file (it is missing or a folder), so nothing was captioned. "
                             "Check the path.")


def loras(texts: Sequence[str]) -> tuple[tuple[str, float], ...]:
    """The --lora choices as (path, strength), each adapter's files found before any model is loaded."""
    chosen = tuple(parse_lora(text) for text in texts)
    for path, _ in chosen:
        adapter_files(path)
    return chosen


def lora_modules(texts: Sequence[str], model: str) -> dict[str, tuple[tuple[str, float], ...]]:
    """serve's --lora-module choices: served name -> its adapters (a name given again adds to its adapters)."""
    named: dict[str, tuple[tuple[str, float], ...]] = {}
    for text in texts:
        name, equals, choice = text.partition("=")
        name = name.strip()
        if not equals or not name or name == Path(model).name:
            raise AdapterError(f"--lora-module {text!r}: give NAME=PATH[:STRENGTH], NAME a model name of its own "
                               f"(not {Path(model).name!r}, the base model's), e.g. storyboard=loras/manga:0.8.")
        named[name] = named.get(name, ()) + loras([choice])
    return named


def cmd_caption(args: argparse.Namespace) -> int:
    check_image_files(args.images)
    model = load_model(args.model, preset=args.preset, loras=loras(args.lora), mmproj=args.mmproj)
    prompt = args.prompt if args.prompt is not None else model.config.caption_prompt or DEFAULT_CAPTION_PROMPT
    for path in args.images:
        chat = model.build_prompt(user=prompt, images=model.encode_images(path, size=args.size, resize=args.resize),
                                  thinking=args.thinking)
        max_new_tokens = args.max_new_tokens or (THINKING_MAX_NEW_TOKENS if chat.prompt.thinking else
                                                 CAPTION_MAX_NEW_TOKENS)
        result = model.generate(chat, max_new_tokens=max_new_tokens, temperature=args.temperature, seed=args.seed)
        print(f"{path}: {result.text}")
    return 0


def cmd_caption_folder(args: argparse.Namespace) -> int:
    shaping = Shaping(trigger=args.trigger, prefix=args.prefix, suffix=args.suffix, template=args.template,
                      ban=tuple(p for text in args.ban for p in phrases(text)),
                      require=tuple(p for text in args.require for p in phrases(text)), max_length=args.max_length)
    job = FolderJob(Path(args.folder), output_dir=Path(args.output_dir) if args.output_dir else None,
                    recursive=args.recursive, start=args.start, limit=args.limit, existing=args.existing,
                    preset=args.preset, prompt=args.prompt, shaping=shaping, dry_run=args.dry_run,
                    batch_size=args.batch_size, size=args.size, resize=args.resize,
                    generation=GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                                 presence_penalty=0.0, seed=args.seed))
    check_job(job)  # a wrong option costs no model load
    model = load_model(args.model, preset=args.vram_preset, loras=loras(args.lora), mmproj=args.mmproj)

    def report(step) -> None:
        for outcome in step.outcomes:
            if outcome.status == "dry run":
                print(f"{outcome.image}: {outcome.caption}")
        print(step.line(), file=sys.stderr)

    outcomes, stopped = run_to_end(model, job, on_step=report)
    print(summary(outcomes, stopped), file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    folder = resolve_model_path(args.model)
    config, ckpt = model_headers(folder, args.mmproj)
    family = family_for(config.model_type)
    lines = [f"model: {folder}", f"family: {family.name}", *family.describe(config)]
    if config.quantization:
        lines.append(f"quantization_config: {json.dumps(config.quantization)}")
    total = sum(info.nbytes for info in ckpt.infos.values())
    lines.append(f"tensors: {len(ckpt.infos)} in {len(ckpt.files)} files, {format_bytes(total)}")
    by_dtype = Counter()
    for info in ckpt.infos.values():
        by_dtype[str(info.dtype).removeprefix("torch.")] += info.nbytes
    lines += [f"  {dtype}: {format_bytes(n)}" for dtype, n in by_dtype.most_common()]
    tensors = {name: (info.shape, info.dtype) for name, info in ckpt.infos.items()}
    lines.append(f"expert layout: {family.expert_layout(config, tensors)}")
    mtp = sum(1 for name in ckpt.infos if family.classify(name)[0] == "mtp")
    if mtp:
        lines.append(f"mtp: {mtp} tensors (not loaded)")
    print("\n".join(lines))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .services.openai_server import run

    options = LoadOptions(preset=args.preset, weight_format=args.weight_format, dense_format=args.dense_format,
                          kv_cache=args.kv_cache, max_context=args.max_context, device=args.device,
                          loras=loras(args.lora), mmproj=args.mmproj)
    run(args.model, options, args.host, args.port, args.api_key_env, args.max_batch_size, args.allow_origin,
        lora_modules(args.lora_module, args.model))
    return 0


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """The placement choices `plan` and `serve` share."""
    parser.add_argument("--preset", default="auto", choices=PRESET_NAMES)
    parser.add_argument("--weight-format", default="auto", choices=WEIGHT_FORMATS,
                        help="format of the routed experts kept in RAM")
    parser.add_argument("--dense-format", default="auto", choices=DENSE_FORMATS,
                        help="format of the dense matrices (attention, DeltaNet, shared experts, lm_head) when the "
                             "CPU computes them: auto keeps the compute dtype (a quantized GGUF's blocks as "
                             "stored); int8 / int4 hold them weight-only quantized (~0.5x / ~0.28x of bf16, at "
                             "some accuracy cost)")
    parser.add_argument("--kv-cache", default="auto", choices=KV_FORMATS)
    parser.add_argument("--max-context", type=int, default=None, help="tokens (default: the preset's)")


def add_lora_argument(parser: argparse.ArgumentParser) -> None:
    """--lora, as `caption`, `caption-folder` and `serve` take it."""
    parser.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]", help=LORA_HELP)


def add_mmproj_argument(parser: argparse.ArgumentParser) -> None:
    """--mmproj, as every command that reads a model takes it."""
    parser.add_argument("--mmproj", default="auto", metavar="auto|none|PATH", help=MMPROJ_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m a3b_core", description="A3B engine tools.")
    commands = parser.add_subparsers(dest="command", required=True)

    caption = commands.add_parser("caption", help="caption images (default: the embedded demo model)")
    caption.add_argument("images", nargs="+", help="image files")
    caption.add_argument("--model", default=DEMO_MODEL_NAME, help=MODEL_HELP + f" (default: {DEMO_MODEL_NAME})")
    caption.add_argument("--prompt", default=None, help="the request (default: the model folder's captioning request, "
                                                        f"else '{DEFAULT_CAPTION_PROMPT}')")
    caption.add_argument("--preset", default="auto", choices=PRESET_NAMES)
    caption.add_argument("--size", type=int, default=384, help="image side in pixels (multiple of 32)")
    caption.add_argument("--resize", default="stretch", choices=RESIZE_MODES)
    caption.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                         help="let the model reason before answering, or not (default: the model's own default: "
                              "off for the demo models, on for Qwen3.5/3.6 releases)")
    caption.add_argument("--max-new-tokens", type=int, default=0,
                         help=f"most tokens of each answer (default: {CAPTION_MAX_NEW_TOKENS}, or "
                              f"{THINKING_MAX_NEW_TOKENS} with thinking, which the reasoning shares)")
    caption.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default, reproducible)")
    caption.add_argument("--seed", type=int, default=0)
    add_lora_argument(caption)
    add_mmproj_argument(caption)
    caption.set_defaults(run=cmd_caption)

    folder = commands.add_parser("caption-folder", help="write a caption .txt for every image in a folder (a LoRA "
                                                        "dataset); a rerun skips the images already captioned")
    folder.add_argument("folder", help="folder of images")
    folder.add_argument("--model", default=DEMO_MODEL_NAME, help=MODEL_HELP + f" (default: {DEMO_MODEL_NAME})")
    folder.add_argument("--recursive", action="store_true", help="also caption the images in subfolders")
    folder.add_argument("--output-dir", default=None,
                        help="write the captions here, in the image folder's layout (default: beside each image)")
    folder.add_argument("--existing", default="skip", choices=EXISTING_POLICIES,
                        help="an image that already has a caption file: skip it (default; a rerun carries on where "
                             "a stopped run ended), overwrite it, or append / prepend the new caption")
    folder.add_argument("--preset", default="natural", choices=list(PRESETS),
                        help="natural: one descriptive sentence; tags: comma-separated tags")
    folder.add_argument("--prompt", default=None, help="the request (default: the preset's; for natural, the model "
                                                       f"folder's captioning request, else '{DEFAULT_CAPTION_PROMPT}')")
    folder.add_argument("--trigger", default="", help="LoRA trigger word written first, followed by ', '")
    folder.add_argument("--prefix", default="", help="text before each caption")
    folder.add_argument("--suffix", default="", help="text after each caption")
    folder.add_argument("--template", default="{caption}",
                        help="the caption's text: {caption}, {name} (image file name without extension), {folder}")
    folder.add_argument("--ban", action="append", default=[],
                        help="phrases removed from every caption (comma-separated; may be repeated)")
    folder.add_argument("--require", action="append", default=[],
                        help="phrases every caption should hold; captions without them are reported")
    folder.add_argument("--max-length", type=int, default=0,
                        help="most characters of the model's caption, cut at a word or tag (0: no limit)")
    folder.add_argument("--dry-run", type=int, default=0, metavar="N",
                        help="print the first N captions and write nothing")
    folder.add_argument("--start", type=int, default=0, help="index of the first image in sorted order")
    folder.add_argument("--limit", type=int, default=0, help="caption at most this many images (0: all)")
    folder.add_argument("--batch-size", type=int, default=8, help="images generated together")
    folder.add_argument("--vram-preset", default="auto", choices=PRESET_NAMES)
    folder.add_argument("--size", type=int, default=384, help="image side in pixels (multiple of 32)")
    folder.add_argument("--resize", default="stretch", choices=RESIZE_MODES)
    folder.add_argument("--max-new-tokens", type=int, default=160)
    folder.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default, reproducible)")
    folder.add_argument("--seed", type=int, default=0)
    add_lora_argument(folder)
    add_mmproj_argument(folder)
    folder.set_defaults(run=cmd_caption_folder)

    plan = commands.add_parser("plan", help="show where each part of a model would live (reads headers only)")
    plan.add_argument("model", help=MODEL_HELP)
    add_placement_arguments(plan)
    plan.add_argument("--ram", type=float, default=None, help="RAM budget in GiB (default: MemAvailable)")
    plan.add_argument("--vram", type=float, default=None,
                      help="free VRAM in GiB (default: this GPU's); given, it plans for a GPU even without CUDA")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_mmproj_argument(plan)
    plan.set_defaults(run=cmd_plan)

    inspect = commands.add_parser("inspect", help="summarize a model folder's config and tensors")
    inspect.add_argument("model", help=MODEL_HELP)
    add_mmproj_argument(inspect)
    inspect.set_defaults(run=cmd_inspect)

    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions)")
    serve.add_argument("model", help=MODEL_HELP)
    add_placement_arguments(serve)
    serve.add_argument("--device", default="auto",
                       help=f"where the model runs: {', '.join(DEVICE_CHOICES)} (default: auto, the first GPU if any)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only; any other address needs "
                            "--api-key-env)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    serve.add_argument("--api-key-env", default=None, metavar="VAR",
                       help="name of the environment variable holding the API key clients must send")
    serve.add_argument("--max-batch-size", type=int, default=32,
                       help="most requests decoded together (default: 32; 1 decodes one request at a time)")
    serve.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web page origin (e.g. http://localhost:3000) whose pages may send requests and read "
                            "the answers; repeat it for several (default: none, web pages are refused)")
    add_lora_argument(serve)
    add_mmproj_argument(serve)
    serve.add_argument("--lora-module", action="append", default=[], metavar="NAME=PATH[:STRENGTH]",
                       help="also serve the model with this LoRA adapter (and any --lora ones) as the model NAME, "
                            "which requests choose with their 'model' field and /v1/models lists; repeatable")
    serve.set_defaults(run=cmd_serve)
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
