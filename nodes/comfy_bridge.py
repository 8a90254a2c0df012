"""The only module that imports ComfyUI (comfy.*, comfy_api, server, folder_paths).

Inside ComfyUI it wires the pack into ComfyUI's folders, messages, progress bars, Stop button and model manager.
Outside ComfyUI (unit tests, scripts) `IN_COMFYUI` is False and every helper is a harmless no-op, so the node logic
that does not need ComfyUI stays importable and testable.
"""
from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable

import torch

from a3b_core.errors import VideoError

try:
    import comfy.model_management as model_management
    import comfy.model_patcher
    import comfy.utils
    import folder_paths
    from comfy_api.latest import ComfyExtension, InputImpl, io, ui
    from server import PromptServer
except ImportError:  # not running inside ComfyUI
    IN_COMFYUI = False
else:
    IN_COMFYUI = True

__all__ = ["IN_COMFYUI", "ComfyExtension", "io", "ui"]

LLM_FOLDER = "LLM"
LORA_FOLDER = "loras"  # ComfyUI's own LoRA folders (models/loras and the users' extra_model_paths entries)
log = logging.getLogger("a3b")


def register_llm_folder() -> None:
    """Adds models/LLM to ComfyUI's model folders (appending, so users' extra_model_paths entries stay)."""
    if IN_COMFYUI:
        folder_paths.add_model_folder_path(LLM_FOLDER, os.path.join(folder_paths.models_dir, LLM_FOLDER))


def llm_roots() -> list[str]:
    return folder_paths.get_folder_paths(LLM_FOLDER) if IN_COMFYUI else []


def lora_roots() -> list[str]:
    """Where the LoRA node looks for adapters: ComfyUI's loras folders, then the LLM folders."""
    return folder_paths.get_folder_paths(LORA_FOLDER) + llm_roots() if IN_COMFYUI else []


def output_directory() -> str:
    if not IN_COMFYUI:
        raise RuntimeError("ComfyUI's output folder is only known inside ComfyUI")
    return folder_paths.get_output_directory()


def input_directory() -> str:
    if not IN_COMFYUI:
        raise RuntimeError("ComfyUI's input folder is only known inside ComfyUI")
    return folder_paths.get_input_directory()


def send_text(node_id: str | None, text: str) -> None:
    """Live text under the node in ComfyUI's frontend (the `progress_text` message)."""
    if IN_COMFYUI and node_id is not None and PromptServer.instance is not None:
        PromptServer.instance.send_progress_text(text, node_id)


def send_event(event: str, data: dict) -> None:
    """A custom websocket message for web/js/a3b.js (which listens with api.addEventListener)."""
    if IN_COMFYUI and PromptServer.instance is not None:
        PromptServer.instance.send_sync(event, data)


def processing_interrupted() -> bool:
    """True once the user pressed Stop (or POST /interrupt); polled by the engine between tokens."""
    return IN_COMFYUI and model_management.processing_interrupted()


def raise_if_interrupted() -> None:
    """Raises ComfyUI's own interrupt exception, so a stopped run ends as 'interrupted', not as an error."""
    if IN_COMFYUI:
        model_management.throw_exception_if_processing_interrupted()


class Progress:
    """The node's progress bar (a no-op outside ComfyUI)."""

    def __init__(self, total: int):
        self._bar = comfy.utils.ProgressBar(max(total, 1)) if IN_COMFYUI else None

    def set(self, done: int, total: int | None = None) -> None:
        if self._bar is not None:
            self._bar.update_absolute(done, total)


def video_frames(video) -> tuple[torch.Tensor, float]:
    """A ComfyUI VIDEO's frames [frames, height, width, channels] (float 0..1) and frame rate, from comfy_api's
    VideoInput.get_components()."""
    try:
        components = video.get_components()
    except Exception as exc:  # PyAV's decoding errors and ComfyUI's own, whatever their class
        raise VideoError(f"the VIDEO input cannot be decoded ({type(exc).__name__}: {exc}); the file is corrupt or not "
                         "a video. Re-export it (e.g. as H.264 mp4) or pick another file.") from exc
    return components.images, float(components.frame_rate)


def video_file_name(video) -> str | None:
    """The file name of a ComfyUI VIDEO read from a file (Load Video gives a VideoFromFile of the file's path), else
    None (a clip built from frames, or read from memory)."""
    if not IN_COMFYUI or not isinstance(video, InputImpl.VideoFromFile):
        return None  # other VIDEOs' get_stream_source() would encode the whole clip into memory
    source = video.get_stream_source()
    return os.path.basename(source) if isinstance(source, str) else None


def engine_device() -> torch.device:
    """The device the engine runs on: ComfyUI's own (so --cpu and --cuda-device hold) when it is a CUDA GPU, else the
    CPU, since the engine runs on CUDA GPUs and CPUs only."""
    return device_for_engine(model_management.get_torch_device() if IN_COMFYUI else torch.device("cpu"))


def device_for_engine(comfy_device: torch.device) -> torch.device:
    return comfy_device if comfy_device.type == "cuda" else torch.device("cpu")


def device_bytes_in_use(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def free_device_memory(bytes_needed: int, device: torch.device) -> None:
    """Asks ComfyUI to unload other models until `bytes_needed` are free on `device` (a GPU; RAM is not managed)."""
    if IN_COMFYUI and bytes_needed > 0 and device.type == "cuda":
        model_management.free_memory(bytes_needed, device)
        model_management.soft_empty_cache()


if IN_COMFYUI:
    class Residency(comfy.model_patcher.ModelPatcher):
        """Stands for a loaded A3B model in ComfyUI's model manager (comfy.model_management.current_loaded_models).

        The engine places its own weights, so nothing here moves tensors. What ComfyUI gets is the bookkeeping it
        needs: how many bytes the model holds on the device, and a way to drop them. When ComfyUI needs the memory
        for another model, or the user asks it to unload models / free memory, it calls `detach`, and the owner's
        `release` frees the engine's weights and caches. The owner is held weakly: a dropped model handle is freed
        by reference counting, and ComfyUI forgets this entry with it.
        """

        def __init__(self, owner_release: Callable[[], None], device: torch.device):
            """`device` is where the model's weights are: its GPU, or the CPU for a model planned into RAM, which
            ComfyUI then never unloads to free VRAM the model does not hold."""
            placeholder = torch.nn.Module()
            placeholder.device = device  # ComfyUI compares this with the load device to see what is resident
            super().__init__(placeholder, load_device=device, offload_device=torch.device("cpu"))
            self._release = weakref.WeakMethod(owner_release)
            self._resident = False

        def mark_loaded(self, device_bytes: int) -> None:
            self.size = max(device_bytes, 0)
            self.model.model_loaded_weight_memory = self.size
            self._resident = True

        def model_size(self) -> int:
            return self.size

        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False) -> int:
            return 0  # loading is the engine's job (A3BModelHandle.acquire); nothing more to move here

        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False) -> int:
            return 0  # all or nothing: ComfyUI then unloads the whole model through detach

        def mark_unloaded(self) -> None:
            self.model.model_loaded_weight_memory = 0
            self._resident = False

        def detach(self, unpatch_all=True):
            # unpatch_all=False is ComfyUI re-registering a model it keeps; only a real unload frees the weights.
            if unpatch_all and self._resident:
                self.mark_unloaded()
                release = self._release()
                if release is not None:
                    release()
            return self.model

    def keep_resident(residency: "Residency") -> None:
        """Marks the model as in use (most recently used), freeing other models' memory for its working space."""
        model_management.load_models_gpu([residency])
else:
    Residency = None

    def keep_resident(residency) -> None:
        pass
