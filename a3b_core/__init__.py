"""a3b_core: a PyTorch engine for Qwen3.5/3.6 "A3B" vision-language models. Never imports ComfyUI."""
from .errors import (A3BError, CheckpointError, ConfigError, GenerationError, ImageError, ModelReleasedError,
                     PlacementError, PromptError, RemoteError, VideoError)
from .media.image import load_image, resize_image, split_batch
from .prompting.conversation import IMAGE_MARKER, VIDEO_MARKER, Turn
from .runtime.sequence_output import GenerationResult, split_reasoning
from .runtime.loader import A3BModel, ChatPrompt, EncodedImages, load_model

__all__ = ["A3BModel", "GenerationResult", "ChatPrompt", "EncodedImages", "load_model", "Turn", "A3BError",
           "CheckpointError", "ConfigError", "GenerationError", "ImageError", "ModelReleasedError", "PlacementError",
           "PromptError", "RemoteError", "VideoError", "IMAGE_MARKER", "VIDEO_MARKER", "load_image", "resize_image",
           "split_batch", "split_reasoning"]
