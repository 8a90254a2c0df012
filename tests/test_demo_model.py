"""The shipped demo model "a3b-demo": it captions held-out scenes through the full engine pipeline, as BF16 and as the
FP8 copy, answers the storyboard request about most of them, captions most held-out clips, honours a wide-gamut ICC
profile, is what the CLI uses by default, and stays a few MB."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import ImageCms
from safetensors import safe_open

from a3b_core.media.image import load_image
from a3b_core.prompting.tokenizer import Tokenizer
from a3b_core.runtime.loader import load_model
from bench.demo_model import dataset
from bench.demo_model.build_tokenizer import build_demo_tokenizer
from bench.demo_model.train import (DEMO_DIR, DEMO_FP8_DIR, TEST_SEED, caption_files, clip_accuracy, config_text,
                                 demo_config, fp8_config, pipeline_accuracy, shot_cases, write_test_images)
from tests.test_image import prophoto_rgb_icc

HELD_OUT_IMAGES = 40
MIN_ACCURACY = 0.95
HELD_OUT_CLIPS, MIN_CLIP_ACCURACY = 20, 0.6
MIN_SHOT_ACCURACY = 0.7
MAX_FOLDER_BYTES = 8 * 2**20


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> list[tuple[Path, str]]:
    """Scenes from a generator seed that training and checkpoint selection never used, saved as PNG files."""
    return write_test_images(tmp_path_factory.mktemp("held_out"), TEST_SEED, HELD_OUT_IMAGES)


@pytest.fixture(scope="module")
def demo_model():
    return load_model("a3b-demo")


@pytest.mark.parametrize("folder, compute_dtype", [("a3b-demo", "auto"), (DEMO_FP8_DIR, "auto")],
                         ids=["bf16", "fp8"])
def test_held_out_captions_are_exact(held_out, folder, compute_dtype):
    model = load_model(folder, compute_dtype=compute_dtype)
    got = caption_files(model, [path for path, _ in held_out])
    wrong = [(want, g) for g, (_, want) in zip(got, held_out) if g != want]
    assert 1 - len(wrong) / len(held_out) >= MIN_ACCURACY, wrong


def test_held_out_storyboard_shots_are_mostly_exact(held_out):
    """The storyboard request (dataset.STORYBOARD_PROMPT) answered with the scene as a shot: 77.0% of 300 held-out
    scenes exact when shipped; 40 here, so the bar has room."""
    accuracy = pipeline_accuracy("a3b-demo", shot_cases(held_out), request=dataset.STORYBOARD_PROMPT)
    assert accuracy >= MIN_SHOT_ACCURACY


def test_held_out_clips_are_mostly_captioned_exactly():
    """The video skill (clips.py): 75% of 200 held-out clips exact when shipped; 20 here, so the bar has room."""
    assert clip_accuracy("a3b-demo", TEST_SEED, HELD_OUT_CLIPS) >= MIN_CLIP_ACCURACY


def test_default_model_is_the_demo(demo_model):
    assert demo_model.folder == DEMO_DIR
    assert demo_model.config.model_type == "qwen3_5_moe"
    assert load_model(None).folder == DEMO_DIR
    assert load_model("a3b-demo-fp8").folder == DEMO_FP8_DIR


def nearest_colour_name(value: np.ndarray) -> str:
    names = list(dataset.COLOURS)
    distances = np.linalg.norm(np.array([dataset.COLOURS[n] for n in names]) - value, axis=-1)
    return names[int(distances.argmin())]


# A held-out scene (generator seed, index) on a blue background that the shipped model captions right.
ICC_SCENE = (TEST_SEED + 1, 26)  # a small yellow circle at the left on a blue background


def test_wide_gamut_image_is_captioned_with_the_right_colour(demo_model, tmp_path):
    seed, index = ICC_SCENE
    sample = dataset.make_samples(seed, index + 1)[index]
    assert sample.scene.background == "blue"
    icc = prophoto_rgb_icc()
    path = tmp_path / "prophoto.png"
    srgb, prophoto = ImageCms.createProfile("sRGB"), ImageCms.ImageCmsProfile(io.BytesIO(icc))
    ImageCms.profileToProfile(sample.image, srgb, prophoto, outputMode="RGB").save(path, icc_profile=icc)
    blue = (np.asarray(sample.image) == dataset.COLOURS["blue"]).all(axis=-1)
    # Its stored values, read as if they were sRGB, are nearer purple; converted from the embedded profile, blue.
    stored = np.asarray(load_image(path, srgb=False), dtype=float)[blue]
    assert nearest_colour_name(np.median(stored, axis=0)) == "purple"
    managed = np.asarray(load_image(path), dtype=float)[blue]
    assert nearest_colour_name(np.median(managed, axis=0)) == "blue"
    prompt = demo_model.build_prompt(user=dataset.CAPTION_PROMPT, images=demo_model.encode_images(path))
    assert demo_model.generate(prompt, max_new_tokens=64, temperature=0).text.strip() == sample.caption


def test_cli_captions_with_the_demo_model_by_default(held_out, demo_model):
    paths = [path for path, _ in held_out[:2]]
    run = subprocess.run([sys.executable, "-m", "a3b_core", "caption", *map(str, paths)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr
    expected = [f"{path}: {caption}" for path, caption in zip(paths, caption_files(demo_model, paths))]
    assert run.stdout.strip().splitlines() == expected


@pytest.mark.parametrize("folder", [DEMO_DIR, DEMO_FP8_DIR], ids=["bf16", "fp8"])
def test_shipped_folders_are_complete_and_small(folder):
    names = {p.name for p in folder.iterdir()}
    assert names == {"config.json", "tokenizer.json", "model.safetensors"}
    assert sum(p.stat().st_size for p in folder.iterdir()) < MAX_FOLDER_BYTES


def test_shipped_configs_are_what_training_writes():
    config = demo_config(Tokenizer(build_demo_tokenizer()))
    assert (DEMO_DIR / "config.json").read_text() == config_text(config)
    assert (DEMO_FP8_DIR / "config.json").read_text() == config_text(fp8_config(config))
    assert config["a3b_caption_prompt"] == dataset.CAPTION_PROMPT


def test_fp8_copy_uses_the_official_per_expert_layout():
    config = json.loads((DEMO_FP8_DIR / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    with safe_open(DEMO_FP8_DIR / "model.safetensors", "pt") as f:
        names = set(f.keys())
        expert = "model.language_model.layers.0.mlp.experts.7.down_proj.weight"
        assert f.get_tensor(expert).dtype == torch.float8_e4m3fn
        assert f.get_tensor(expert + "_scale_inv").dtype == torch.bfloat16
        assert f.get_tensor("model.language_model.layers.3.self_attn.q_proj.weight_scale_inv").dtype == torch.float32
        assert f.get_tensor("model.visual.blocks.0.attn.qkv.weight").dtype == torch.bfloat16
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    with safe_open(DEMO_DIR / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.language_model.layers.0.mlp.experts.gate_up_proj").dtype == torch.bfloat16
        assert f.get_tensor("model.language_model.layers.0.linear_attn.A_log").dtype == torch.float32
