"""Errors a user can cause. Every message names the input, what was expected, and the fix."""


class A3BError(Exception):
    """Base class for every failure the user can cause or fix."""


class ConfigError(A3BError):
    """config.json is missing, unreadable, or describes a model we do not support."""


class CheckpointError(A3BError):
    """Weight files are missing, corrupt, unsafe, or disagree with the config."""


class ImageError(A3BError):
    """An input image cannot be decoded or is out of the supported range."""


class PromptError(A3BError):
    """A prompt is empty, too long, or its [[IMG]] markers disagree with the images."""


class GenerationError(A3BError):
    """Sampling settings or generation limits are out of range."""


class PlacementError(A3BError):
    """A memory budget cannot hold the model in any format."""


class ModelReleasedError(A3BError):
    """A model handle is used after release(); the model must be loaded again."""


class RemoteError(A3BError):
    """A remote OpenAI-compatible server cannot be reached, refuses a request, or answers in an unexpected form."""


class ChatTemplateError(A3BError):
    """A model folder's chat template cannot be read, compiled or rendered, or renders a prompt the model cannot use."""


class VideoError(ImageError):
    """An input clip cannot be decoded, holds no frames, or does not fit the model's context."""


class AdapterError(A3BError):
    """A LoRA adapter cannot be read, is unsafe, uses what is not supported, or does not fit the model."""
