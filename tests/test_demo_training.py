"""The demo model's training script, run for a few steps: it exports BF16 and FP8 folders the engine loads, and the
same command repeats to the byte (the shipped checkpoint's reproducibility rests on that)."""
from __future__ import annotations

from pathlib import Path

import torch

from a3b_core.runtime.loader import load_model
from bench.demo_model import dataset, train


def short_run(out: Path, *options: str, steps: int = 2, video_steps: int = 2,
              storyboard_steps: int = 2) -> tuple[Path, Path]:
    bf16, fp8 = out / "bf16", out / "fp8"
    train.main(["train", "--vision-steps", str(steps), "--steps", str(steps), "--batch", "2", "--warmup", "1",
                "--validation", "2", "--video-steps", str(video_steps), "--video-clips", "1", "--video-scenes", "1",
                "--video-warmup", "1", "--clip-validation", "2", "--eval-every", "2",
                "--video-eval-every", "2", "--storyboard-steps", str(storyboard_steps), "--storyboard-scenes", "1",
                "--storyboard-clips", "1", "--storyboard-warmup", "1", "--storyboard-eval-every", "2",
                "--threads", str(torch.get_num_threads()), "--out", str(bf16), "--out-fp8", str(fp8), *options])
    return bf16, fp8


def test_a_short_run_exports_loadable_folders_and_repeats_to_the_byte(tmp_path):
    first, second = short_run(tmp_path / "first"), short_run(tmp_path / "second")
    for a, b in zip(first, second):
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    for folder in first:
        model = load_model(folder)
        prompt = model.build_prompt(user=dataset.CAPTION_PROMPT)
        assert len(model.generate(prompt, max_new_tokens=3, temperature=0).token_ids) >= 1


def test_each_phase_continued_from_an_export_gives_the_bytes_of_the_one_command(tmp_path):
    """The shipped checkpoint's third phase was run from the second phase's export and its fourth from the third's
    (--init-from); this is the same model the one training command makes."""
    whole, _ = short_run(tmp_path / "whole")
    first, _ = short_run(tmp_path / "first", video_steps=0, storyboard_steps=0)
    video, _ = short_run(tmp_path / "video", "--init-from", str(first), steps=0, storyboard_steps=0)
    storyboard, _ = short_run(tmp_path / "storyboard", "--init-from", str(video), steps=0, video_steps=0)
    assert (whole / "model.safetensors").read_bytes() == (storyboard / "model.safetensors").read_bytes()
    assert (whole / "model.safetensors").read_bytes() != (video / "model.safetensors").read_bytes()
