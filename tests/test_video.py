"""Video through the whole engine (frames -> sampling -> patches -> vision tower -> timestamped prompt -> M-RoPE ->
logits) against the transformers oracle: Qwen3VLProcessor (with Qwen3VLVideoProcessor as the release configures it,
the per-frame pixel cap on) and the model, fp32, on the tiny Qwen3.5 and Qwen3-VL checkpoints; plus reading video
files and the errors a user can cause."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from a3b_core import EncodedImages, PromptError, VideoError, load_model
from a3b_core.media.video import _read_with_opencv, read_video
from a3b_core.prompting.built_in_templates import qwen3_5_prompt, qwen3_vl_prompt
from a3b_core.prompting.conversation import Turn, VideoTokens
from a3b_core.prompting.tokenizer import Tokenizer
from nodes.captions import caption_stems
from nodes.prompt_spec import PER_IMAGE, PromptSpec, build_prompts
from nodes.video_batch import encode_clips, item_names
from tests import tiny_models as tm
from tests.test_bad_inputs import FIX
from tests.test_prompt import official_template, official_text
from tests.tiny_qwen3_vl import build_qwen3_vl_fixtures
from tests.tiny_tokenizer import build_tiny_tokenizer

TOL = 1e-4
DATA = Path(__file__).parent / "data"
FAMILIES = {"qwen3_5": "qwen3_5_chat_template.jinja", "qwen3_vl": "qwen3_vl_instruct_chat_template.jinja"}
FRAME_RATE = 8.0  # of the test clips; fps 2 samples 4 of 16 frames, fps 6 samples 5 of 7 (an odd count, padded)
SIZES = [(64, 96), (120, 80)]  # (height, width): exact multiples of 32, and sizes the processor rounds
FPS = [2.0, 6.0]

pytestmark = pytest.mark.usefixtures("one_thread")


class Oracle:
    """transformers' processor and model for one tiny checkpoint folder."""

    def __init__(self, folder: Path, template: str):
        from transformers import (AutoModelForImageTextToText, PreTrainedTokenizerFast, Qwen2VLImageProcessorPil,
                                  Qwen3VLProcessor, Qwen3VLVideoProcessor)
        keys = ("size", "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
        self.processor = Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil(**{k: tm.PREPROCESSOR[k] for k in keys}),
            tokenizer=PreTrainedTokenizerFast(tokenizer_object=build_tiny_tokenizer()),
            video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824},
                                                  image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                                  cap_pixels_per_frame=True),
            chat_template=(DATA / template).read_text(encoding="utf-8"))
        self.model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()

    def run(self, content: list[dict], frames: np.ndarray, fps: float, images: list | None = None) -> dict:
        from transformers.video_utils import VideoMetadata
        messages = [{"role": "user", "content": content}]
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  enable_thinking=False)
        metadata = VideoMetadata(total_num_frames=len(frames), fps=FRAME_RATE, height=frames.shape[1],
                                 width=frames.shape[2])
        inputs = self.processor(text=[text], images=images, videos=[frames], video_metadata=[metadata],
                                videos_kwargs={"fps": fps}, return_tensors="pt")
        with torch.no_grad():
            logits = self.model(**inputs).logits
            positions, deltas = self.model.model.get_rope_index(
                inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"),
                inputs["video_grid_thw"])
        return {"input_ids": inputs["input_ids"], "positions": positions, "deltas": deltas.flatten().tolist(),
                "logits": logits, "video_grid_thw": inputs["video_grid_thw"]}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    folders = {"qwen3_5": lambda: tm.build_fixtures().moe_hf, "qwen3_vl": lambda: build_qwen3_vl_fixtures().moe_hf}
    folder = folders[request.param]()
    return load_model(folder, preset="cpu", compute_dtype="float32"), Oracle(folder, FAMILIES[request.param])


def clip(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """A moving gradient with noise: frames differ, so a wrong frame order or timestamp changes the logits."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    shots = [np.stack([(x * 255 // width + 20 * t) % 256, (y * 255 // height) % 256,
                       np.full_like(x, 40 * t % 256)], axis=-1) for t in range(frames)]
    return np.clip(np.stack(shots) + rng.integers(-20, 21, (frames, height, width, 3)), 0, 255).astype(np.uint8)


def assert_matches(model, video: EncodedImages, prompt_ids: tuple[int, ...], ref: dict) -> None:
    ids = torch.tensor([prompt_ids])
    assert torch.equal(ids, ref["input_ids"]), "token ids differ"
    positions, deltas = model.positions(ids, video)
    assert torch.equal(positions, ref["positions"]), "M-RoPE positions differ"
    assert deltas == ref["deltas"]
    diff = (model.logits(ids, images=video) - ref["logits"]).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[1]}x{s[0]}")
@pytest.mark.parametrize("fps", FPS, ids=lambda f: f"fps{f:g}")
@pytest.mark.parametrize("frames", [4, 7, 16])
def test_video_prompt_matches_reference(family, frames, fps, size):
    model, oracle = family
    pixels = clip(frames, *size)
    ref = oracle.run([{"type": "video"}, {"type": "text", "text": "What happens in this clip?"}], pixels, fps)
    video = model.encode_video(torch.from_numpy(pixels), frame_rate=FRAME_RATE, fps=fps)
    assert video.grids == [tuple(ref["video_grid_thw"][0].tolist())]
    prompt = model.build_prompt(user="What happens in this clip?", images=video, thinking=False)
    assert_matches(model, video, prompt.input_ids, ref)


def test_image_and_video_in_one_prompt_match_reference(family, fixtures):
    from PIL import Image
    model, oracle = family
    pixels = clip(7, 64, 96, seed=1)
    image = Image.open(fixtures.wide_image).convert("RGB")
    content = [{"type": "image"}, {"type": "text", "text": " then "}, {"type": "video"},
               {"type": "text", "text": ": what changed?"}]
    ref = oracle.run(content, pixels, 2.0, images=[image])
    media = model.encode_images(fixtures.wide_image, resize="native") + \
        model.encode_video(torch.from_numpy(pixels), frame_rate=FRAME_RATE, fps=2.0)
    prompt = model.build_prompt(user="[[IMG]] then [[VID]]: what changed?", images=media, thinking=False)
    assert_matches(model, media, prompt.input_ids, ref)


def test_float_frames_as_comfyui_gives_them_encode_as_uint8(family):
    model, _ = family
    pixels = clip(4, 64, 64)
    as_uint8 = model.encode_video(torch.from_numpy(pixels), frame_rate=4.0)
    as_float = model.encode_video(torch.from_numpy(pixels).float() / 255, frame_rate=4.0)
    assert torch.equal(as_uint8.embeds[0], as_float.embeds[0]) and as_uint8.timestamps == as_float.timestamps


def test_sampling_options_change_the_encoding(family):
    model, _ = family
    pixels = torch.from_numpy(clip(16, 128, 128))
    base = model.encode_video(pixels, frame_rate=8.0)  # fps 2 of a 2 s clip: frames 0, 5, 10, 15 in 2 groups
    assert base.grids == [(2, 8, 8)] and base.timestamps == [(0.3125, 1.5625)]
    assert model.encode_video(pixels, frame_rate=8.0, fps=4.0).grids[0][0] == 4
    assert model.encode_video(pixels, frame_rate=8.0, fps=8.0, max_frames=6).grids[0][0] == 3
    assert model.encode_video(pixels, frame_rate=8.0, fps=0.5, min_frames=8).grids[0][0] == 4
    assert model.encode_video(pixels, frame_rate=8.0, max_frame_tokens=1).grids == [(2, 4, 4)]  # the pixel floor
    # a 4 s clip at fps 2: frames 0, 2, 4, 6, 9, 11, 13, 15, each pair's mean time
    assert model.encode_video(pixels, frame_rate=4.0).timestamps == [(0.25, 1.25, 2.5, 3.5)]


def test_markers_place_images_and_videos_by_kind(family, fixtures):
    model, _ = family
    media = model.encode_images(fixtures.wide_image, resize="native") + \
        model.encode_video(torch.from_numpy(clip(4, 64, 64)), frame_rate=4.0)
    with pytest.raises(PromptError, match=r"marker 1 is \[\[VID\]\].*an image") as error:
        model.build_prompt(user="[[VID]] and [[IMG]]", images=media)
    assert FIX.search(str(error.value))
    with pytest.raises(PromptError, match="markers"):
        model.build_prompt(user="only [[VID]]", images=media)
    prompt = model.build_prompt(user="Compare them.", images=media)  # no markers: both before the text
    text = prompt.prompt.text
    assert text.index("<|image_pad|>") < text.index("<|video_pad|>") < text.index("Compare them.")


@pytest.mark.parametrize("add_vision_id", [False, True])
@pytest.mark.parametrize("family_name, thinking", [("qwen3_5", False), ("qwen3_5", True), ("qwen3_vl", False),
                                                    ("qwen3_vl", True)])
def test_videos_are_placed_and_numbered_as_the_released_templates_do(family_name, thinking, add_vision_id):
    files = {("qwen3_5", False): "qwen3_5_chat_template.jinja", ("qwen3_5", True): "qwen3_5_chat_template.jinja",
             ("qwen3_vl", False): "qwen3_vl_instruct_chat_template.jinja",
             ("qwen3_vl", True): "qwen3_vl_thinking_chat_template.jinja"}
    build = {"qwen3_5": qwen3_5_prompt, "qwen3_vl": qwen3_vl_prompt}[family_name]
    history = (Turn("What happens in [[VID]]?", "It moves.", num_images=1),)
    counts = [VideoTokens(2, (0.3, 1.5)), 4, VideoTokens(3, (0.5,))]
    prompt = build(Tokenizer(build_tiny_tokenizer()), "Compare [[IMG]] with [[VID]].", image_token_counts=counts,
                   history=history, thinking=thinking, add_vision_id=add_vision_id)
    video, image = {"type": "video"}, {"type": "image"}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What happens in "}, video,
                                             {"type": "text", "text": "?"}]},
                {"role": "assistant", "content": "It moves."},
                {"role": "user", "content": [{"type": "text", "text": "Compare "}, image,
                                             {"type": "text", "text": " with "}, video, {"type": "text", "text": "."}]}]
    expected = official_text(messages, thinking=thinking, add_vision_id=add_vision_id,
                             template=official_template(DATA / files[family_name, thinking]))
    assert prompt.text == expected
    assert ("Video 2: " in prompt.text) == add_vision_id and ("Picture 1: " in prompt.text) == add_vision_id
    # the processor's expansion of each pad, in order: a video's frame groups each after its timestamp
    group = "<{}><|vision_start|>" + "<|video_pad|>" * 2 + "<|vision_end|>"
    expansions = iter([group.format("0.3 seconds") + group.format("1.5 seconds"), "<|image_pad|>" * 4,
                       "<0.5 seconds><|vision_start|>" + "<|video_pad|>" * 3 + "<|vision_end|>"])
    expanded = re.sub(r"<\|image_pad\|>|<\|video_pad\|>", lambda _: next(expansions), expected)
    assert list(prompt.input_ids) == build_tiny_tokenizer().encode(expanded, add_special_tokens=False).ids


# ----------------------------------------------------------------------------------------------- files
def write_clip(path: Path, frames: np.ndarray, rate: int) -> None:
    av = pytest.importorskip("av")  # ComfyUI's requirements bring PyAV
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for pixels in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())


def test_a_video_file_is_read_with_its_frame_rate(tmp_path):
    pixels = clip(6, 64, 96)
    write_clip(tmp_path / "clip.mp4", pixels, rate=12)
    decoded = read_video(tmp_path / "clip.mp4")
    assert decoded.frames.shape == (6, 64, 96, 3) and decoded.frames.dtype == torch.uint8
    assert decoded.frame_rate == 12.0
    assert (decoded.frames.float() - torch.from_numpy(pixels).float()).abs().mean() < 12  # lossy, but the same clip


def test_without_pyav_opencv_reads_the_same_clip(tmp_path):
    write_clip(tmp_path / "clip.mp4", clip(6, 64, 96), rate=12)
    with_pyav = read_video(tmp_path / "clip.mp4")
    with_opencv = _read_with_opencv(tmp_path / "clip.mp4", "the clip")
    assert with_opencv.frame_rate == with_pyav.frame_rate and with_opencv.frames.shape == with_pyav.frames.shape
    assert (with_opencv.frames.float() - with_pyav.frames.float()).abs().mean() < 3  # the decoders' colour rounding
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all" * 100)
    with pytest.raises(VideoError, match="broken.mp4") as error:
        _read_with_opencv(tmp_path / "broken.mp4", "video file 'broken.mp4'")
    assert FIX.search(str(error.value))


def test_encoding_a_file_equals_encoding_its_frames(family, tmp_path):
    model, _ = family
    write_clip(tmp_path / "clip.mp4", clip(6, 64, 96), rate=12)
    decoded = read_video(tmp_path / "clip.mp4")
    from_file = model.encode_video(tmp_path / "clip.mp4", fps=4.0)
    from_frames = model.encode_video(decoded.frames, frame_rate=12, fps=4.0)
    assert torch.equal(from_file.embeds[0], from_frames.embeds[0]) and from_file.timestamps == from_frames.timestamps


# ----------------------------------------------------------------------------------------------- bad input
def test_a_zero_frame_clip_is_refused(family):
    model, _ = family
    with pytest.raises(VideoError, match="0-frame clip") as error:
        model.encode_video(torch.zeros(0, 64, 64, 3), frame_rate=24)
    assert "video frames of shape (0, 64, 64, 3)" in str(error.value) and FIX.search(str(error.value))


def test_frames_of_different_sizes_are_refused(family):
    model, _ = family
    frames = [np.zeros((64, 64, 3), np.uint8), np.zeros((64, 64, 3), np.uint8), np.zeros((32, 64, 3), np.uint8)]
    with pytest.raises(VideoError, match=r"frame 3 has shape \(32, 64, 3\) but frame 1 has \(64, 64, 3\)") as error:
        model.encode_video(frames, frame_rate=24)
    assert FIX.search(str(error.value))


@pytest.mark.parametrize("content", [b"", b"not a video at all" * 100, b"\x00\x00\x00\x18ftypmp42" + bytes(300)])
def test_a_corrupt_video_file_is_refused(family, tmp_path, content):
    model, _ = family
    path = tmp_path / "broken.mp4"
    path.write_bytes(content)
    with pytest.raises(VideoError, match="broken.mp4") as error:
        model.encode_video(path)
    assert FIX.search(str(error.value))


def test_a_clip_longer_than_the_context_names_what_fits(tmp_path):
    model = load_model(tm.build_fixtures().moe_hf, preset="cpu", compute_dtype="float32", max_context=256)
    pixels = torch.from_numpy(clip(64, 128, 128))  # 16 s at 4 frames per second
    with pytest.raises(VideoError) as error:
        model.encode_video(pixels, frame_rate=4.0, fps=2.0)  # 32 frames: 16 groups of 16 tokens and a timestamp
    message = str(error.value)
    assert "32 frames sampled at fps 2" in message and "context holds 256" in message and FIX.search(message)
    frames = int(message.split("max_frames to ")[1].split()[0])
    model.encode_video(pixels, frame_rate=4.0, fps=2.0, max_frames=frames)  # what the message names fits
    with pytest.raises(VideoError):
        model.encode_video(pixels, frame_rate=4.0, fps=2.0, max_frames=frames + 2)


@pytest.mark.parametrize("options, message", [
    (dict(frame_rate=0), "frame_rate"), (dict(frame_rate=24, fps=-1), "fps"),
    (dict(frame_rate=24, max_frames=0), "max_frames"), (dict(frame_rate=24, min_frames=9, max_frames=8), "min_frames"),
    (dict(), "no frame rate"),
])
def test_bad_sampling_options_are_named(family, options, message):
    model, _ = family
    with pytest.raises(VideoError, match=message) as error:
        model.encode_video(torch.zeros(4, 64, 64, 3), **options)
    assert FIX.search(str(error.value))


# ----------------------------------------------------------------------------------------------- A3B Video Encode
def test_video_encode_appends_clips_after_the_connected_images(family, fixtures):
    model, _ = family
    images = model.encode_images(fixtures.wide_image, resize="native")
    frames = torch.from_numpy(clip(7, 64, 96)).float() / 255  # an IMAGE batch, as ComfyUI gives it
    encoded, summary = encode_clips(model, None, frames, 8.0, images, fps=6.0, max_frames=64, max_frame_tokens=768)
    assert len(encoded) == 2 and encoded.timestamps[0] is None
    alone = model.encode_video(frames, frame_rate=8.0, fps=6.0)
    assert torch.equal(encoded.embeds[1], alone.embeds[0]) and encoded.timestamps[1] == alone.timestamps[0]
    assert summary == f"frames: 3 frame groups x 6 = 18 vision tokens, {alone.timestamps[0][0]:.1f} s to " \
                      f"{alone.timestamps[0][-1]:.1f} s"
    fewer, _ = encode_clips(model, None, frames, 8.0, None, fps=6.0, max_frames=4, max_frame_tokens=768)
    assert fewer.grids[0][0] == 2  # the max_frames widget acts


def test_video_encode_names_each_item_for_save_captions(family, fixtures):
    model, _ = family
    images = model.encode_images(fixtures.wide_image, resize="native")
    frames = torch.from_numpy(clip(4, 64, 64)).float() / 255
    encoded, _ = encode_clips(model, None, frames, 8.0, images)  # frames carry no file name: named by place
    assert item_names(encoded) == "image_00001\nclip_00002"
    walk = model.encode_video(frames, frame_rate=8.0)
    walk.names = ["walk cycle.mp4"]  # as A3B Video Encode names a clip Load Video read from a file
    both = encoded + walk  # a chain of Video Encode nodes keeps every item's name, in order
    assert item_names(both) == "image_00001\nclip_00002\nwalk cycle.mp4"
    assert both[2].names == ["walk cycle.mp4"] and both[:2].names == [None, None]
    assert caption_stems(item_names(both), 3, "caption") == ["image_00001", "clip_00002", "walk cycle"]


def test_video_encode_needs_a_clip_and_names_the_input(family):
    model, _ = family
    with pytest.raises(VideoError, match="neither 'video' nor 'frames'") as error:
        encode_clips(model, None, None, 24.0, None)
    assert FIX.search(str(error.value))
    with pytest.raises(VideoError, match="input 'frames'.*0-frame clip"):
        encode_clips(model, None, torch.zeros(0, 64, 64, 3), 24.0, None)


def test_per_image_mode_gives_one_prompt_per_clip(family):
    model, _ = family
    clips = model.encode_video(torch.from_numpy(clip(4, 64, 64)), frame_rate=4.0) + \
        model.encode_video(torch.from_numpy(clip(8, 64, 64, seed=3)), frame_rate=4.0)
    prompts = build_prompts(model, PromptSpec(user="Caption [[VID]] in one sentence.", images=clips), PER_IMAGE)
    assert len(prompts) == 2
    for index, prompt in enumerate(prompts):
        assert prompt.images.embeds[0] is clips.embeds[index] and len(prompt.images) == 1
        assert prompt.prompt.text.count("<|video_pad|>") == 1
    results = model.generate_batch(prompts, max_new_tokens=3, temperature=0)
    assert [len(result.token_ids) for result in results] == [3, 3]
