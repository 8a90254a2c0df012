"""Folder captioning speed and memory: images per minute one image per request against batched requests, each with
the prompts' shared start prefilled with every image and prefilled once per run (reused), in the same run on the same
folder; on the demo model and on the random benchmark model under a vision tower; and the resident set over a large
folder.

    python bench/caption_folder.py                         # a3b-demo and the 1.8B bench model: 200 images per mode,
                                                           # RSS over 2,000 images
    python bench/caption_folder.py --images 20 --rss-images 40 --rounds 1 --bench-model small   # a smoke run
    python bench/caption_folder.py --model models/LLM/X --bench-model none    # any vision-language model folder
    python bench/caption_folder.py --images 0                                 # the memory run alone

The images are demo scenes (the demo model's own generator) written once into a temporary folder. The modes run
interleaved for `--rounds` rounds, each into its own fresh caption folder, and the median is reported. The RSS run
captions `--rss-images` images in batches with the first model and samples the resident set after every batch; the
baseline is the sample after the first tenth of the images (allocator pools and one-off buffers are in place by then).
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: a3b_core, bench

from a3b_core import load_model  # noqa: E402
from a3b_core.runtime.options import GenerationOptions
from a3b_core.services.caption_folder import FolderJob, caption_folder
from bench.bench_model import checkpoint_folder  # noqa: E402
from bench.demo_model import dataset  # noqa: E402
from bench.soak import rss_bytes  # noqa: E402

MiB = 2**20


def write_scenes(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for index in range(count):
        dataset.draw(dataset.random_scene(rng), rng).save(folder / f"scene_{index:05d}.png")


def images_per_minute(model, images: Path, captions: Path, batch_size: int, reuse_prefix: bool,
                      generation: GenerationOptions) -> float:
    job = FolderJob(images, output_dir=captions, batch_size=batch_size, reuse_prefix=reuse_prefix,
                    generation=generation)
    started = time.perf_counter()
    captioned = 0
    for step in caption_folder(model, job):
        captioned = step.captioned
    return 60 * captioned / (time.perf_counter() - started)


def rss_over_folder(model, images: Path, captions: Path, batch_size: int,
                    generation: GenerationOptions) -> list[tuple[int, int]]:
    """(images done, RSS bytes) after every batch."""
    job = FolderJob(images, output_dir=captions, batch_size=batch_size, generation=generation)
    return [(step.done, rss_bytes()) for step in caption_folder(model, job) if step.done]


def speed_table(model, name: str, images: Path, work: Path, args: argparse.Namespace,
                generation: GenerationOptions) -> None:
    """Images per minute of each case with the prefix prefilled per image and reused, rounds interleaved."""
    cases = {"one image per request": 1, f"batches of {args.batch_size}": args.batch_size}
    rates: dict[tuple[str, bool], list[float]] = {(case, reuse): [] for case in cases for reuse in (False, True)}
    for round_number in range(args.rounds):
        for (case, reuse), values in rates.items():
            out = work / f"captions-{round_number}-{cases[case]}-{reuse}"
            values.append(images_per_minute(model, images, out, cases[case], reuse, generation))
            shutil.rmtree(out)
    median = {key: statistics.median(values) for key, values in rates.items()}
    print(f"\nmodel: {name} · {args.images} images per mode · {args.rounds} rounds · "
          f"max_new_tokens {args.max_new_tokens}")
    print("| case | images/min, prefix with each image | images/min, prefix reused | reused / each |\n"
          "| --- | --- | --- | --- |")
    for case in cases:
        each, reused = median[case, False], median[case, True]
        print(f"| {case} | {each:.1f} | {reused:.1f} | {reused / each:.2f}x |")
    one, batched = (median[case, True] for case in cases)
    print(f"batched / one per request (prefix reused): {batched / one:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="a3b-demo", help="a vision-language model folder, or a3b-demo")
    parser.add_argument("--bench-model", choices=("full", "small", "none"), default="full",
                        help="also the random benchmark model under a vision tower (bench_model.py --vision): the "
                             "1.8B one, its small stand-in, or none")
    parser.add_argument("--images", type=int, default=200, help="images per mode and round (0: no speed run)")
    parser.add_argument("--batch-size", type=int, default=8, help="images per request in the batched mode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rss-images", type=int, default=2000, help="images in the memory run (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    models = [args.model]
    if args.bench_model != "none" and args.images:  # the bench model is in the speed run only
        models.append(str(checkpoint_folder(small=args.bench_model == "small", vision=True)))
    generation = GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=0.0, presence_penalty=0.0)
    work = Path(tempfile.mkdtemp(prefix="a3b-caption-bench-"))
    try:
        first = load_model(models[0])
        if args.images:
            speed = work / "speed"
            write_scenes(speed, args.images)
            speed_table(first, models[0], speed, work, args, generation)
            for name in models[1:]:
                model = load_model(name)
                speed_table(model, name, speed, work, args, generation)
                model.release()
        if args.rss_images:
            model = first
            write_scenes(work / "rss", args.rss_images)
            samples = rss_over_folder(model, work / "rss", work / "captions-rss", args.batch_size, generation)
            baseline = next(rss for done, rss in samples if done >= args.rss_images // 10)
            first, peak, last = samples[0][1], max(rss for _, rss in samples), samples[-1][1]
            print(f"\nRSS over {args.rss_images} images ({models[0]}): start {first / MiB:.1f} MiB, "
                  f"{baseline / MiB:.1f} MiB after {args.rss_images // 10}, peak {peak / MiB:.1f} MiB, "
                  f"end {last / MiB:.1f} MiB ({100 * (last / baseline - 1):+.2f}% from the baseline)")
    finally:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
