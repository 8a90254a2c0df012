"""The compute device: which one, whether tensors can live there, its compute dtype, and its memory queries.

Every query of the CUDA runtime goes through here and answers None (or does nothing) where no CUDA runtime is
present, so the engine runs unchanged with a stand-in accelerator (the tests place the model on fake CUDA tensors).
"""
from __future__ import annotations

import torch

from ..errors import PlacementError
from .options import DEVICE_CHOICES


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto": the first CUDA GPU when there is one, else the CPU; or "cpu", "cuda", "cuda:N". A device that cannot
    hold a tensor is refused here, before anything is loaded."""
    if str(device) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise PlacementError(f"device {device!r} is not a device name; use one of {', '.join(DEVICE_CHOICES)}.") \
            from exc
    if chosen.type not in ("cpu", "cuda"):
        raise PlacementError(f"device {device!r} is not supported: the engine runs on the CPU and on CUDA GPUs. Use "
                             f"one of {', '.join(DEVICE_CHOICES)}.")
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    try:
        torch.empty(0, device=chosen)
    except (RuntimeError, AssertionError) as exc:  # no driver, no such GPU, or a torch built without CUDA
        raise PlacementError(f"device {chosen} cannot be used ({str(exc).splitlines()[0]}). Pick a GPU that "
                             "torch.cuda.device_count() lists, or device 'cpu'.") from exc
    return chosen


def is_real_cuda(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def bf16_is_native(device: torch.device) -> bool:
    """bf16 runs at full speed: on CPUs (widened to fp32 where not native, still halving the weights read) and on
    GPUs of compute capability 8.0 (Ampere) and newer; older GPUs only emulate it, slowly or not at all."""
    if not is_real_cuda(device):
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device as the driver reports it; None elsewhere, or where no driver answers."""
    if device.type != "cuda":
        return None
    try:
        return torch.cuda.mem_get_info(device)[0]
    except (RuntimeError, AssertionError):  # no driver, or a torch built without CUDA
        return None


def allocated_bytes(device: torch.device) -> int:
    """Bytes torch's allocator holds for tensors on a CUDA device (0 elsewhere)."""
    return torch.cuda.memory_allocated(device) if is_real_cuda(device) else 0


def reset_peak(device: torch.device) -> None:
    if is_real_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if is_real_cuda(device) else None


def empty_cache(device: torch.device) -> None:
    """Hands the CUDA allocator's cached, unused blocks back to the driver."""
    if is_real_cuda(device):
        torch.cuda.empty_cache()
