"""A3B Video Encode's work: ComfyUI clips (a VIDEO, and/or IMAGE frames with their frame rate) through the model's
vision tower, one encoded item per clip, after any images or clips given to it; and the items' names for caption
files."""
from __future__ import annotations

from typing import Any

from a3b_core import EncodedImages
from a3b_core.errors import VideoError

from . import comfy_bridge as bridge


def encode_clips(model: Any, video: Any, frames: Any, frame_rate: float, before: EncodedImages | None,
                 **sampling: Any) -> tuple[EncodedImages, str]:
    """The clips of `video` (ComfyUI's VIDEO) and `frames` ([frames, height, width, channels] at `frame_rate`), in
    that order, encoded with `sampling` (model.encode_video's fps, max_frames, ...) and appended to `before`; and a
    line per clip saying what it costs in prompt tokens. A VIDEO read from a file keeps the file's name."""
    clips = []
    if video is not None:
        clips.append(("video", *bridge.video_frames(video), bridge.video_file_name(video)))
    if frames is not None:
        clips.append(("frames", frames, frame_rate, None))
    if not clips:
        raise VideoError("A3B Video Encode: neither 'video' nor 'frames' is connected; connect a VIDEO (e.g. from Load "
                         "Video) or the frames of a clip as an IMAGE batch.")
    encoded = before if before is not None else EncodedImages([], [])
    lines = []
    for name, clip, rate, file_name in clips:
        progress = bridge.Progress(1)

        def after_groups(done: int, total: int) -> None:
            progress.set(done, total)
            bridge.raise_if_interrupted()

        bridge.raise_if_interrupted()
        try:
            item = model.encode_video(clip, frame_rate=rate, progress=after_groups, **sampling)
        except VideoError as exc:
            raise VideoError(f"A3B Video Encode, input '{name}': {exc}") from exc
        item.names = [file_name]
        encoded = encoded + item
        lines.append(clip_summary(name, item))
    return encoded, "\n".join(lines)


def item_names(encoded: EncodedImages) -> str:
    """One line per item for A3B Save Captions' names: its file name, else "image_00001" / "clip_00002" by its place
    (an IMAGE or frames carry no file name)."""
    return "\n".join(name or f"{'image' if stamps is None else 'clip'}_{place:05d}"
                     for place, (name, stamps) in enumerate(zip(encoded.names, encoded.timestamps), 1))


def clip_summary(name: str, item: EncodedImages) -> str:
    """E.g. "video: 8 frame groups x 144 = 1152 vision tokens, 0.3 s to 7.5 s"."""
    stamps, tokens = item.timestamps[0], item.token_counts[0]
    return (f"{name}: {len(stamps)} frame groups x {tokens // len(stamps)} = {tokens} vision tokens, "
            f"{stamps[0]:.1f} s to {stamps[-1]:.1f} s")
