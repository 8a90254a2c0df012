"""A stand-in CUDA device for machines without a GPU, built on torch's fake tensors.

Inside `FakeCuda()`, a tensor made on or moved to "cuda" is a FakeTensor (shape, dtype and device, no data), and
every operation that touches one runs under torch's FakeTensorMode: it checks devices exactly as CUDA does, so mixing
a CPU tensor with a CUDA one raises as it would on a real GPU. Everything else runs for real on the CPU (weights are
read and converted, CPU experts compute real numbers). With `fake_weights=True`, tensors read from files
(torch.frombuffer, which safetensors checkpoints are mapped through) are fake too, CPU ones included: shapes only,
for models too big to hold (the real 35B's shapes); prompts and other bookkeeping stay real.

Reading a CUDA tensor's values on the host (`.tolist()`, `.item()`, `bool()`, a copy to the CPU) has no data to give:
the stand-in answers ones of the right shape (valid ids, finite flags set) and counts the read in `host_reads`, so a test can bound the
device->host synchronizations per token. `memory` tracks the bytes of live CUDA storages and their peak (the
allocations torch's CUDA allocator would hold, without its caching slack). Attention on the stand-in GPU allocates
what a fused kernel does, its output: CUDA GPUs run the engine's attention calls in fused kernels (flash for a whole
prompt, memory-efficient for masked calls, which takes any head size that is a multiple of 8); bench/gpu_check.py
measures the real thing.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.eye, torch.rand, torch.randn,
             torch.linspace, torch.randint, torch.empty_strided}
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.numpy}


class CudaMemory(TorchDispatchMode):
    """Live and peak bytes of CUDA storages, counted as each operation returns them and as they are freed."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def add(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
            return
        storage = tensor.untyped_storage()  # the same Python object for as long as the storage lives
        if id(storage) in self._seen:
            return
        self._seen[id(storage)] = storage
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, size)

    def _freed(self, size: int) -> None:
        self.live -= size

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self.add(tensor)
        return out


class FakeCuda(TorchFunctionMode):
    def __init__(self, fake_weights: bool = False):
        super().__init__()
        self.fake_weights = fake_weights
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.memory = CudaMemory()
        self.host_reads = 0

    def __enter__(self):
        if self.fake_weights:  # torch.frombuffer is not dispatched as a torch function: replaced while inside
            self._frombuffer = torch.frombuffer
            torch.frombuffer = self._fake_frombuffer
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self.fake_weights:
            torch.frombuffer = self._frombuffer

    def _fake_frombuffer(self, buffer, *, dtype: torch.dtype, count: int = -1, offset: int = 0) -> torch.Tensor:
        count = (len(buffer) - offset) // dtype.itemsize if count < 0 else count
        with self.fake:
            return torch.empty(count, dtype=dtype)

    def _fake_call(self, func, args, kwargs):
        with self.fake, self.memory:
            return func(*args, **kwargs)

    def _to_fake(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.fake:
            return tensor if isinstance(tensor, FakeTensor) else self.fake.from_tensor(tensor)

    def _fused_attention(self, q, k, v, attn_mask=None, **options) -> torch.Tensor:
        """What a fused attention kernel (flash, memory-efficient) allocates: its output, no scores. torch's fake
        tensors would run the unfused math kernel, which a GPU uses only where no fused one applies."""
        for name, tensor in (("key", k), ("value", v), ("attn_mask", attn_mask)):
            if isinstance(tensor, torch.Tensor) and tensor.device != q.device:
                raise RuntimeError(f"scaled_dot_product_attention: {name} is on {tensor.device}, query on {q.device}")
        return self._fake_call(torch.empty, ((*q.shape[:-1], v.shape[-1]),), {"dtype": q.dtype, "device": q.device})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fakes = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, FakeTensor)]
        if func is F.scaled_dot_product_attention and fakes and args[0].device.type == "cuda":
            return self._fused_attention(*args, **kwargs)
        if func in HOST_READS and fakes:
            if args[0].device.type == "cuda":
                self.host_reads += 1
            with torch._C.DisableTorchFunction(), unset_fake_temporarily():
                return func(torch.ones(args[0].shape, dtype=args[0].dtype), *args[1:], **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda) and isinstance(args[0], torch.Tensor):
            source, target, dtype = args[0], _target(func, args, kwargs), _dtype(args, kwargs)
            if isinstance(source, FakeTensor) and source.device.type == "cuda" and target == "cpu":
                self.host_reads += 1
                with torch._C.DisableTorchFunction():
                    return torch.ones(source.shape, dtype=dtype or source.dtype)
            if target == "cuda":
                return self._fake_call(func, (self._to_fake(source), *args[1:]), kwargs)
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            # made on the CPU first: torch.tensor of one value skips the dispatcher on its way to the device
            host = func(*args, **{**kwargs, "device": "cpu"})
            return self._fake_call(torch.Tensor.to, (self._to_fake(host), kwargs["device"]), {})
        if fakes or (func in FACTORIES and _is_cuda(kwargs.get("device"))):
            return self._fake_call(func, args, kwargs)
        return func(*args, **kwargs)


def _is_cuda(device: object) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _target(func, args, kwargs) -> str | None:
    """The device type a to()/cpu()/cuda() call moves to, or None when it only changes the dtype."""
    if func is torch.Tensor.cpu:
        return "cpu"
    if func is torch.Tensor.cuda:
        return "cuda"
    device = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device)):
            device = arg
        elif isinstance(arg, torch.Tensor):
            device = arg.device
    return None if device is None else torch.device(device).type


def _dtype(args, kwargs) -> torch.dtype | None:
    for arg in args[1:]:
        if isinstance(arg, torch.dtype):
            return arg
        if isinstance(arg, torch.Tensor):
            return arg.dtype
    return kwargs.get("dtype")
