"""Soak: hundreds of generations in one process; resident memory must level off and no cache may outlive its call.

    python bench/soak.py                       # 300 generations on the tiny MoE test model, a sample every 25
    python bench/soak.py --model models/LLM/X  # any model folder (slow on CPU for real sizes)

The mix repeats every 15 generations: text prompts with and without thinking, prompts with a freshly encoded image
(two sizes, alternating), greedy and sampled decoding, varied answer lengths; every fifth generation is interrupted
through `should_stop` after a few tokens, as ComfyUI's Stop button does. Every `--every` generations the script
collects garbage and samples the resident set (RSS) and the number of live Cache and EncodedImages objects. The
first sample is the warm-up baseline (allocator pools and one-off buffers are in place by then); growth is
last RSS / baseline RSS - 1. It fails (exit 1) when growth is 5% or more, or when any sample finds a live Cache or
EncodedImages, since every generation's cache and every prompt's images belong to that call alone.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: a3b_core, tests

import numpy as np  # noqa: E402
import torch  # noqa: E402

from a3b_core import EncodedImages, load_model  # noqa: E402
from a3b_core.models.qwen3_5.cache import Cache  # noqa: E402

MAX_GROWTH = 0.05
MIX = 15  # the generation pattern below repeats with this period
USER_TEXTS = ["Write one sentence about a red circle.", "Name three colours.", "Describe a kitchen at dawn.",
              "What is two plus two?", "Give a short caption for a photo of a dog."]


@dataclass(frozen=True)
class Sample:
    generations: int  # done before this sample
    rss_bytes: int
    live_caches: int
    live_images: int


@dataclass(frozen=True)
class SoakReport:
    start_rss_bytes: int  # before the first generation
    samples: list[Sample]
    seconds: float
    tokens: int
    image_prompts: int
    cancelled: int

    @property
    def growth(self) -> float:
        """RSS growth from the warm-up sample (the first) to the last."""
        return self.samples[-1].rss_bytes / self.samples[0].rss_bytes - 1

    @property
    def leaked(self) -> bool:
        return any(s.live_caches or s.live_images for s in self.samples)


def rss_bytes() -> int:
    """This process's current resident set (not the peak)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux
        import psutil
        return psutil.Process().memory_info().rss


def count_live(kind: type) -> int:
    return sum(type(obj) is kind for obj in gc.get_objects())  # type(), not isinstance: no proxy lookups


def sample(generations: int) -> Sample:
    gc.collect()
    return Sample(generations, rss_bytes(), count_live(Cache), count_live(EncodedImages))


def test_images() -> list[np.ndarray]:
    """Two images of different sizes (so different token counts), as ComfyUI would pass them: HxWx3 floats."""
    rng = np.random.default_rng(0)
    return [rng.random((256, 256, 3), dtype=np.float32), rng.random((192, 320, 3), dtype=np.float32)]


def one_generation(model, index: int, images: list[np.ndarray]) -> tuple[int, bool, bool]:
    """Generation number `index` of the mix; returns (new tokens, had an image, was cancelled)."""
    step = index % MIX
    with_image = step % 3 == 0
    thinking = step % 3 == 2
    cancel_after = 3 if step % 5 == 4 else None
    user = USER_TEXTS[index % len(USER_TEXTS)]
    encoded = model.encode_images(images[index % 2]) if with_image else None
    prompt = model.build_prompt(f"[[IMG]] {user}" if with_image else user, images=encoded, thinking=thinking)
    emitted = 0

    def on_text(_text: str) -> None:
        nonlocal emitted
        emitted += 1

    def should_stop() -> bool:
        return cancel_after is not None and emitted >= cancel_after

    result = model.generate(prompt, max_new_tokens=8 + 4 * (step % 5), temperature=0 if step % 2 else 0.7,
                            seed=index, thinking_budget=6 if thinking else None, on_text=on_text,
                            should_stop=should_stop)
    return len(result.token_ids), with_image, result.stop_reason == "cancelled"


def run_soak(model, generations: int = 300, every: int = 25, log=None) -> SoakReport:
    """Runs the mix `generations` times, sampling memory and live objects every `every` generations."""
    images = test_images()
    samples, tokens, image_prompts, cancelled = [], 0, 0, 0
    start_rss = sample(0).rss_bytes
    started = time.perf_counter()
    for index in range(generations):
        new, with_image, was_cancelled = one_generation(model, index, images)
        tokens, image_prompts, cancelled = tokens + new, image_prompts + with_image, cancelled + was_cancelled
        if (index + 1) % every == 0:
            samples.append(sample(index + 1))
            if log:
                log(samples[-1])
    return SoakReport(start_rss, samples, time.perf_counter() - started, tokens, image_prompts, cancelled)


def default_model_folder() -> Path:
    from tests.tiny_models import build_fixtures  # test fixtures: built once, cached on disk
    return build_fixtures().moe_fused_bf16


def print_sample(s: Sample) -> None:
    print(f"{s.generations:>11} {s.rss_bytes / 2**20:>9.1f} {s.live_caches:>11} {s.live_images:>11}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--model", type=Path, help="model folder (default: the tiny MoE test checkpoint)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or default_model_folder()
    model = load_model(folder, preset="cpu", compute_dtype="float32")
    print(f"model {folder}; {args.generations} generations, a sample every {args.every}")
    print(f"{'generations':>11} {'RSS MiB':>9} {'live Cache':>11} {'live images':>11}")
    report = run_soak(model, args.generations, args.every, log=print_sample)
    ok = report.growth < MAX_GROWTH and not report.leaked
    print(f"RSS before the first generation: {report.start_rss_bytes / 2**20:.1f} MiB")
    print(f"{report.seconds:.1f} s, {report.tokens} tokens, {report.image_prompts} image prompts, "
          f"{report.cancelled} cancelled; RSS growth after warm-up {100 * report.growth:+.2f}% "
          f"(limit {100 * MAX_GROWTH:.0f}%); leaked caches/images: {'yes' if report.leaked else 'none'}; "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
