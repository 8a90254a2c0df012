"""a3b_core: a PyTorch engine for Qwen3.5/3.6 "A3B" vision-language models. Never imports ComfyUI."""
from .engine import A3BModel, ChatPrompt, EncodedImages, load_model
from .errors import (A3BError, CheckpointError, ConfigError, GenerationError, ImageError, ModelReleasedError,
                     PlacementError, PromptError)
from .generation import GenerationResult
from .prompt import Turn

__all__ = ["A3BModel", "GenerationResult", "ChatPrompt", "EncodedImages", "load_model", "Turn", "A3BError", "CheckpointError",
           "ConfigError", "GenerationError", "ImageError", "ModelReleasedError", "PlacementError", "PromptError"]
