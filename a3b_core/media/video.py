"""Video pipeline: a clip (frames [T, H, W, C] with their frame rate, or a video file) -> sampled frames -> resized
-> normalized patches, with each frame group's timestamp.

It reproduces the model's video processor (Qwen3VLVideoProcessor with the release's video_preprocessor_config.json and
the per-frame pixel cap of Qwen's reference code) bit for bit:
- sampling: `fps` frames per second of the clip, at least `min_frames` and at most `max_frames` (and never more than
  the clip has), spread evenly from the first frame to the last (np.linspace, rounded);
- size: one size for every frame, from smart_resize over the whole clip, whose pixel budget is `max_frame_tokens`
  merged patches per frame or an even share of `max_pixels`, whichever is less (but not below 1.05 x `min_pixels`);
- pixels: bicubic with antialiasing on uint8 (torch's, which the processor's torchvision resize runs on the CPU),
  then (x - 127.5) / 127.5 in float32; a clip of an odd frame count repeats its last frame;
- frames are paired (the vision tower's temporal patch); a pair's timestamp is the mean of its two frames' times.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import VideoError
from .image import MAX_ASPECT_RATIO, MAX_INPUT_PIXELS

# The release's video_preprocessor_config.json (Qwen3-VL and Qwen3.5 ship the same one).
DEFAULT_FPS = 2.0
MIN_FRAMES = 4
MAX_FRAMES = 768
MAX_FRAME_TOKENS = 768  # merged patches (LM tokens) per frame, Qwen's reference per-frame cap
MIN_PIXELS = 4096  # size.shortest_edge: pixels of the whole clip, at least
MAX_PIXELS = 25165824  # size.longest_edge: pixels of the whole clip, at most
MAX_CLIP_PIXELS = 32 * MAX_INPUT_PIXELS  # decoded pixels a clip may hold in memory (about 13 GB of uint8 RGB)


@dataclass(frozen=True)
class VideoFrames:
    """Decoded frames [T, H, W, 3] uint8 and their rate."""
    frames: torch.Tensor
    frame_rate: float


@dataclass(frozen=True)
class SampledVideo:
    """What the vision tower and the prompt need of a clip: patches, grid (frame groups, h, w) and the timestamps."""
    pixel_values: torch.Tensor  # [groups * h * w, C * temporal * patch * patch] float32
    grid: tuple[int, int, int]
    timestamps: tuple[float, ...]  # seconds, one per frame group
    frame_indices: tuple[int, ...]  # which frames of the clip were used


def describe(src: Any) -> str:
    if isinstance(src, (str, os.PathLike)):
        return f"video file '{os.fspath(src)}'"
    if isinstance(src, (np.ndarray, torch.Tensor)):
        return f"video frames of shape {tuple(src.shape)} and dtype {src.dtype}"
    if isinstance(src, (list, tuple)):
        return f"list of {len(src)} video frames"
    return f"video input of type {type(src).__name__}"


# ------------------------------------------------------------------------------------------------- frames in
def as_uint8_frames(frames: Any, name: str) -> torch.Tensor:
    """[T, H, W, C] (C 1, 3 or 4; uint8 or float 0..1, as ComfyUI's IMAGE), or a list of [H, W, C] frames of one
    size -> uint8 [T, H, W, 3] (grey repeated, alpha dropped)."""
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise VideoError(f"{name} holds no frames; give a clip with at least one frame.")
        shapes = [tuple(getattr(frame, "shape", ())) for frame in frames]
        if len(set(shapes)) > 1:
            first = shapes[0]
            other = next(index for index, shape in enumerate(shapes) if shape != first)
            raise VideoError(f"{name}: frame {other + 1} has shape {shapes[other]} but frame 1 has {first}; every "
                             "frame of a clip must have one size. Give frames of one size (scale them first, e.g. "
                             "with ComfyUI's Upscale Image node).")
        frames = [torch.as_tensor(np.asarray(frame)) if isinstance(frame, np.ndarray) else frame for frame in frames]
        if not all(isinstance(frame, torch.Tensor) for frame in frames):
            raise VideoError(f"{name} holds items that are not frames; give numpy arrays or tensors [H, W, C].")
        frames = torch.stack(frames)
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(np.ascontiguousarray(frames))
    if not isinstance(frames, torch.Tensor):
        raise VideoError(f"{name} is not a clip; give frames [frames, height, width, channels] or a video file path.")
    if frames.dim() == 4 and frames.shape[0] == 0:
        raise VideoError(f"{name} holds no frames (0-frame clip); give a clip with at least one frame.")
    if frames.dim() != 4 or frames.shape[-1] not in (1, 3, 4):
        raise VideoError(f"{name} is not a clip of frames; give [frames, height, width, channels] with 1, 3 or 4 "
                         "channels (channels last, as ComfyUI's IMAGE).")
    count, height, width = frames.shape[:3]
    if height == 0 or width == 0:
        raise VideoError(f"{name} has frames of a degenerate size {width}x{height}; give frames of at least 1x1.")
    if count * height * width > MAX_CLIP_PIXELS:
        raise VideoError(f"{name} holds {count * height * width:,} pixels, more than the limit of "
                         f"{MAX_CLIP_PIXELS:,}; trim the clip or lower its resolution before loading it.")
    frames = frames.detach().cpu()
    if frames.is_floating_point():
        # A frame at a time: the clip may be a whole ComfyUI IMAGE batch, which float copies would multiply.
        converted = torch.empty(frames.shape, dtype=torch.uint8)
        for frame, out in zip(frames, converted):
            if not bool(torch.isfinite(frame).all()):
                raise VideoError(f"{name} contains NaN or infinite values; give finite values in 0..1.")
            # Round (not truncate) so that k/255 floats from ComfyUI come back as exactly k.
            out.copy_(frame.float().clamp(0, 1).mul_(255).round_())
        frames = converted
    elif frames.dtype != torch.uint8:
        raise VideoError(f"{name} has dtype {frames.dtype}; use uint8 or float in 0..1.")
    if frames.shape[-1] == 1:
        frames = frames.expand(-1, -1, -1, 3)
    return frames[..., :3].contiguous()


def read_video(path: str | os.PathLike) -> VideoFrames:
    """Every frame of a video file and its frame rate, decoded with PyAV when it is installed, else OpenCV."""
    name = describe(path)
    if not os.path.isfile(path):
        raise VideoError(f"{name} does not exist or is not a file; check the path.")
    try:
        import av
    except ImportError:
        return _read_with_opencv(path, name)
    return _read_with_pyav(av, path, name)


def _read_with_pyav(av: Any, path: str | os.PathLike, name: str) -> VideoFrames:
    frames: list[np.ndarray] = []
    try:
        with av.open(os.fspath(path)) as container:
            if not container.streams.video:
                raise VideoError(f"{name} has no video stream; give a video file (e.g. mp4 or webm).")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24"))
                _check_decoded(frames, name)
    except av.FFmpegError as exc:
        raise VideoError(f"{name} cannot be decoded ({exc}); it is corrupt or not a video. Re-export it (e.g. as "
                         "H.264 mp4) or re-download it.") from None
    return _decoded(frames, rate, name)


def _read_with_opencv(path: str | os.PathLike, name: str) -> VideoFrames:
    import cv2
    capture = cv2.VideoCapture(os.fspath(path))
    try:
        if not capture.isOpened():
            raise VideoError(f"{name} cannot be opened as a video; it is corrupt or in a format OpenCV cannot read. "
                             "Re-export it (e.g. as H.264 mp4).")
        rate = capture.get(cv2.CAP_PROP_FPS)
        frames: list[np.ndarray] = []
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
            _check_decoded(frames, name)
    finally:
        capture.release()
    return _decoded(frames, rate, name)


def _check_decoded(frames: list[np.ndarray], name: str) -> None:
    if frames[-1].shape != frames[0].shape:
        raise VideoError(f"{name}: frame {len(frames)} is {frames[-1].shape[1]}x{frames[-1].shape[0]} but frame 1 is "
                         f"{frames[0].shape[1]}x{frames[0].shape[0]}; every frame of a clip must have one size. "
                         "Re-export the video at one resolution.")
    if len(frames) * frames[0].shape[0] * frames[0].shape[1] > MAX_CLIP_PIXELS:
        raise VideoError(f"{name} decodes to more than {MAX_CLIP_PIXELS:,} pixels; trim the clip or lower its "
                         "resolution before loading it.")


def _decoded(frames: list[np.ndarray], rate: Any, name: str) -> VideoFrames:
    if not frames:
        raise VideoError(f"{name} holds no decodable frames (0-frame clip); it is corrupt or empty. Re-export it or "
                         "give another file.")
    value = float(rate) if rate else 0.0
    if not math.isfinite(value) or value <= 0:
        raise VideoError(f"{name} does not say its frame rate; re-export it with a frame rate, or decode it yourself "
                         "and pass the frames with frame_rate.")
    return VideoFrames(as_uint8_frames(frames, name), value)


# ------------------------------------------------------------------------------------------------- sampling
def sample_indices(total: int, frame_rate: float, fps: float, min_frames: int, max_frames: int) -> list[int]:
    """Which of a clip's `total` frames to use: `fps` per second of the clip, within [min_frames, max_frames] and at
    most all of them, evenly spread from the first to the last."""
    count = int(total / frame_rate * fps)
    count = min(max(count, min_frames), max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def group_timestamps(indices: Sequence[int], frame_rate: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Seconds of each frame group: the mean of its first and last frame's times (an incomplete last group repeats
    its last frame)."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [index / frame_rate for index in indices]
    return tuple((times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size))


def frame_size(frames: int, height: int, width: int, factor: int, temporal_patch_size: int, min_pixels: int,
               max_pixels: int, max_frame_tokens: int, name: str) -> tuple[int, int]:
    """(height, width) every frame is resized to: multiples of `factor`, the clip's pixels (frames rounded to whole
    groups) within the budget, each frame at most `max_frame_tokens` merged patches."""
    per_frame = max(min(max_frame_tokens * factor * factor, max_pixels // frames), int(min_pixels * 1.05))
    budget = per_frame * frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoError(f"{name} has frames {width}x{height}, an aspect ratio above {MAX_ASPECT_RATIO} that the "
                         "vision encoder cannot take; crop the frames first.")
    # Python's round() (half to even) on purpose: it is what the processor uses.
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal_patch_size) * temporal_patch_size
    if t_bar * h_bar * w_bar > budget:
        beta = math.sqrt(frames * height * width / budget)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_patches(frames: torch.Tensor, patch_size: int, temporal_patch_size: int, merge_size: int) -> torch.Tensor:
    """Normalized frames [T, 3, H, W] (T a multiple of temporal_patch_size) -> [groups * gh * gw, 3 * T * p * p] in
    the processor's order: group, block row, block column, row and column in the block; then C, frame, pixel."""
    count, channels, height, width = frames.shape
    groups, gh, gw = count // temporal_patch_size, height // patch_size, width // patch_size
    patches = frames.view(groups, temporal_patch_size, channels, gh // merge_size, merge_size, patch_size,
                          gw // merge_size, merge_size, patch_size)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(groups * gh * gw, channels * temporal_patch_size * patch_size * patch_size)


def preprocess_video(frames: torch.Tensor, frame_rate: float, *, fps: float = DEFAULT_FPS,
                     min_frames: int = MIN_FRAMES, max_frames: int = MAX_FRAMES,
                     max_frame_tokens: int = MAX_FRAME_TOKENS, min_pixels: int = MIN_PIXELS,
                     max_pixels: int = MAX_PIXELS, patch_size: int = 16, temporal_patch_size: int = 2,
                     merge_size: int = 2, name: str = "the video") -> SampledVideo:
    """uint8 frames [T, H, W, 3] at `frame_rate` -> the sampled clip's patches, grid and timestamps."""
    _check_sampling(frame_rate, fps, min_frames, max_frames, max_frame_tokens, name)
    indices = sample_indices(frames.shape[0], frame_rate, fps, min_frames, max_frames)
    clip = frames[indices].permute(0, 3, 1, 2).contiguous()  # [T, 3, H, W]
    factor = patch_size * merge_size
    height, width = frame_size(len(indices), clip.shape[2], clip.shape[3], factor, temporal_patch_size, min_pixels,
                               max_pixels, max_frame_tokens, name)
    if (height, width) != tuple(clip.shape[2:]):
        clip = F.interpolate(clip, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    if pad := -len(indices) % temporal_patch_size:
        clip = torch.cat((clip, clip[-1:].expand(pad, -1, -1, -1)))
    mean = torch.tensor([0.5, 0.5, 0.5]) * 255.0
    std = torch.tensor([0.5, 0.5, 0.5]) * 255.0
    normed = (clip.float() - mean[:, None, None]) / std[:, None, None]
    pixel_values = to_patches(normed, patch_size, temporal_patch_size, merge_size)
    grid = (clip.shape[0] // temporal_patch_size, height // patch_size, width // patch_size)
    return SampledVideo(pixel_values, grid, group_timestamps(indices, frame_rate, temporal_patch_size),
                        tuple(indices))


def _check_sampling(frame_rate: float, fps: float, min_frames: int, max_frames: int, max_frame_tokens: int,
                    name: str) -> None:
    for label, value in (("frame_rate", frame_rate), ("fps", fps)):
        _check_rate(value, label, name)
    for label, value in (("min_frames", min_frames), ("max_frames", max_frames),
                         ("max_frame_tokens", max_frame_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise VideoError(f"{label} is {value!r}; set it to a whole number of at least 1.")
    if min_frames > max_frames:
        raise VideoError(f"min_frames {min_frames} is above max_frames {max_frames}; lower min_frames or raise "
                         "max_frames.")


def load_video(src: Any, frame_rate: float | None) -> VideoFrames:
    """A file path, or frames with their `frame_rate` -> decoded uint8 frames and rate."""
    name = describe(src)
    if isinstance(src, (str, os.PathLike)):
        return read_video(src)
    if frame_rate is None:
        raise VideoError(f"{name} has no frame rate; pass frame_rate (the clip's frames per second, e.g. 24), "
                         "which the timestamps and frame sampling need.")
    _check_rate(frame_rate, "frame_rate", name)
    return VideoFrames(as_uint8_frames(src, name), float(frame_rate))


def _check_rate(value: Any, label: str, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)) or not 0 < value < math.inf:
        raise VideoError(f"{label} of {name} is {value!r}; pass a positive number of frames per second (e.g. 24 for "
                         f"the clip's frame_rate, {DEFAULT_FPS:g} for the fps sampled).")
