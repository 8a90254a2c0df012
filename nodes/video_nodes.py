"""A3B Video Encode."""
from __future__ import annotations

from typing import Any

from a3b_core import EncodedImages
from a3b_core.media.video import DEFAULT_FPS, MAX_FRAME_TOKENS, MAX_FRAMES

from .comfy_bridge import io
from .model_handle import A3BModelHandle
from .video_batch import encode_clips, item_names
from .wires import ImagesWire, ModelWire

CATEGORY = "A3B"


class A3BVideoEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="A3BVideoEncode",
            display_name="A3B Video Encode",
            category=CATEGORY,
            description="Runs the model's vision tower over a clip: frames are sampled at 'fps', paired, and each "
                        "pair gets its timestamp in the prompt. Write [[VID]] in A3B Prompt where the clip goes; in "
                        "per-image mode each clip gets its own answer.",
            inputs=[
                ModelWire.Input("model", tooltip="From A3B Model Loader."),
                io.Video.Input("video", optional=True, tooltip="A clip, e.g. from Load Video (its own frame rate is "
                                                               "used)."),
                io.Image.Input("frames", optional=True,
                               tooltip="Or the frames of one clip as an IMAGE batch, shown at 'frame_rate'."),
                io.Float.Input("frame_rate", default=24.0, min=0.01, max=1000.0, step=0.01,
                               tooltip="Frames per second of 'frames' (ignored for 'video', which carries its own)."),
                io.Float.Input("fps", default=DEFAULT_FPS, min=0.05, max=60.0, step=0.05,
                               tooltip="Frames sampled per second of the clip (Qwen's default: 2). More frames see "
                                       "faster motion and cost more tokens."),
                io.Int.Input("max_frames", default=64, min=1, max=MAX_FRAMES,
                             tooltip="Most frames sampled from a clip, evenly spread over it when fps would take "
                                     "more. Every 2 frames are one frame group of tokens."),
                io.Int.Input("max_frame_tokens", default=MAX_FRAME_TOKENS, min=1, max=16384,
                             tooltip="Most vision tokens per frame group: larger frames are scaled down (a 384x384 "
                                     "frame is 144). Lower it for long or high-resolution clips."),
                ImagesWire.Input("images", optional=True,
                                 tooltip="Encoded images or clips to put before these (from A3B Image Encode or "
                                         "another A3B Video Encode), to mix images and videos in one prompt."),
            ],
            outputs=[ImagesWire.Output(display_name="images",
                                       tooltip="The encoded clips (after any connected 'images'), for A3B Prompt."),
                     io.String.Output(display_name="names",
                                      tooltip="One name per item of 'images', for A3B Save Captions' names: a clip "
                                              "from Load Video is named after its file; others by their place, "
                                              "e.g. clip_00002.")],
        )

    @classmethod
    def execute(cls, model: A3BModelHandle, frame_rate: float, fps: float, max_frames: int, max_frame_tokens: int,
                video: Any = None, frames: Any = None, images: EncodedImages | None = None) -> io.NodeOutput:
        encoded, summary = encode_clips(model.acquire(), video, frames, frame_rate, images, fps=fps,
                                        max_frames=max_frames, max_frame_tokens=max_frame_tokens)
        return io.NodeOutput(encoded, item_names(encoded), ui={"a3b_tokens": [summary]})  # shown on the node by web/js/a3b.js
