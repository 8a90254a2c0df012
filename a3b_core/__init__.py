"""a3b_core: a PyTorch engine for Qwen3.5/3.6 "A3B" vision-language models. Never imports ComfyUI."""
from .engine import A3BModel, ChatPrompt, EncodedImages, load_model
from .errors import (A3BError, CheckpointError, ConfigError, GenerationError, ImageError, ModelReleasedError,
                     PlacementError, PromptError, RemoteError, VideoError)
from .generation import GenerationResult, split_reasoning
from .image import load_image, resize_image, split_batch
from .prompt import IMAGE_MARKER, VIDEO_MARKER, Turn

__all__ = ["A3BModel", "GenerationResult", "ChatPrompt", "EncodedImages", "load_model", "Turn", "A3BError",
           "CheckpointError", "ConfigError", "GenerationError", "ImageError", "ModelReleasedError", "PlacementError",
           "PromptError", "RemoteError", "VideoError", "IMAGE_MARKER", "VIDEO_MARKER", "load_image", "resize_image",
           "split_batch", "split_reasoning"]
