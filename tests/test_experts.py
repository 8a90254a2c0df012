"""Routed-expert storage formats: kernels vs their own dequantized weights, error bounds, memory, disk cache."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from a3b_core import load_model
from a3b_core.formats.int4 import TorchInt4Stack
from a3b_core.formats.stores import QuantizedStack

FORMAT_BYTES_VS_BF16 = {"int8": (0.49, 0.52), "int4": (0.26, 0.29), "fp8": (0.49, 0.52)}


@pytest.mark.parametrize("rows", [5, 40])  # int8 switches from torch's kernel to dequantize-then-multiply at 32
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_stack_matmul_matches_its_dequantised_weights(fmt, rows):
    torch.manual_seed(0)
    w = torch.randn(3, 256, 512) * 0.05
    stack = QuantizedStack(fmt, tuple(w.shape))
    for e in range(3):
        stack.set(e, w[e])
    x = torch.randn(rows, 512)
    for e in range(3):
        deq = stack.dequantize(e)
        assert (deq - w[e]).abs().max() < {"int8": 0.002, "int4": 0.02, "fp8": 0.01}[fmt]
        exact = x @ deq.t()
        assert (stack.matmul(e, x).float() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_a_matrix_set_in_row_parts_is_stored_as_set_whole(fmt):
    """QuantizedLinear quantizes a large matrix (an lm_head) a part at a time; 320 rows: two whole parts and a tail."""
    torch.manual_seed(0)
    w = torch.randn(320, 256) * 0.05
    whole, parts = QuantizedStack(fmt, (1, 320, 256)), QuantizedStack(fmt, (1, 320, 256))
    whole.set(0, w)
    for first in (0, 128, 256):
        parts.set(0, w[first:first + 128], first)
    for a, b in zip(whole.buffers(), parts.buffers()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match="multiples of 128 rows"):
        parts.set(0, w[:64], 64)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_expert_bytes_relative_to_bf16(fmt):
    e, out, inp = 8, 512, 1024
    stack = QuantizedStack(fmt, (e, out, inp))
    ratio = sum(b.numel() * b.element_size() for b in stack.buffers()) / (e * out * inp * 2)
    low, high = FORMAT_BYTES_VS_BF16[fmt]
    assert low <= ratio <= high


# Stated bounds: mean |logit error| of quantized routed experts against the fp32 model (tiny random MoE, logit std
# 0.57; measured 0.007 bf16 experts, 0.024 int8, 0.23 int4 with 128-wide groups, and 0.17 for the whole FP8 release
# with its fp8 dense matrices), and the worst token (a flipped router choice moves a whole row).
LOGIT_BOUNDS = {"bf16": (0.02, 1.0), "fp8": (0.25, 2.5), "int8": (0.05, 2.0), "int4": (0.35, 3.0)}


@pytest.mark.parametrize("fmt", LOGIT_BOUNDS)
def test_quantised_experts_stay_within_bounds(fixtures, fmt, tmp_path, monkeypatch):
    monkeypatch.setenv("A3B_CACHE_DIR", str(tmp_path))
    ids = fixtures.refs(fixtures.moe_fused_bf16)["text.input_ids"]
    reference = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32").logits(ids)
    # fp8 is never made from a bf16 checkpoint: measure the FP8 release of the same weights (its dense parts are fp8 too)
    folder = fixtures.moe_fp8 if fmt == "fp8" else fixtures.moe_fused_bf16
    model = load_model(folder, preset="cpu", compute_dtype="float32", weight_format=fmt)
    err = (model.logits(ids) - reference).abs()
    mean_bound, max_bound = LOGIT_BOUNDS[fmt]
    assert err.mean() < mean_bound and err.max() < max_bound


def test_released_fp8_experts_are_kept_as_released(fixtures):
    ids = fixtures.refs(fixtures.moe_fp8)["text.input_ids"]
    as_float = load_model(fixtures.moe_fp8, preset="cpu", compute_dtype="float32").logits(ids)
    as_fp8 = load_model(fixtures.moe_fp8, preset="cpu", compute_dtype="float32", weight_format="fp8").logits(ids)
    torch.testing.assert_close(as_fp8, as_float, atol=1e-5, rtol=0)


def test_torch_int4_packing_holds_the_stores_values():
    """Where no numba kernel computes an int4 matrix, it is repacked for torch's int4 kernel: the same weights (its
    scales and zero points rounded to bf16), the same products."""
    torch.manual_seed(0)
    w = torch.randn(2, 256, 384) * 0.05  # 384 inputs: three groups of 128
    stack = QuantizedStack("int4", tuple(w.shape))
    for e in range(2):
        stack.set(e, w[e])
    repacked = TorchInt4Stack(stack)
    x = torch.randn(3, 384)
    for e in range(2):
        assert (repacked.dequantize(e) - stack.dequantize(e)).abs().max() < 2e-3
        exact = x @ stack.dequantize(e).t()
        assert (repacked.matmul(e, x).float() - exact).abs().max() < 0.02 * exact.abs().max()


def test_the_int4_cache_serves_every_instruction_set(fixtures, tmp_path):
    """The int4 cache holds the package's own layout, the same on every CPU; torch's packing, which depends on the
    instruction set, is made at load. A cache written under one instruction set is read under another (without
    numba, so that torch's packing is made), to the same logits."""
    script = ("import sys, torch; from safetensors.torch import save_file; from a3b_core import load_model; "
              "from a3b_core.release.safetensors import Checkpoint; from a3b_core.runtime.loader import expert_cache_dir; "
              "model = load_model(sys.argv[1], preset='cpu', compute_dtype='float32', weight_format='int4'); "
              "save_file({'logits': model.logits(torch.tensor([[1, 5, 9, 13, 2]]))}, sys.argv[2]); "
              "print(torch.backends.cpu.get_cpu_capability(), expert_cache_dir(Checkpoint(sys.argv[1]), 'int4'))")
    folders, logits = {}, []
    for capability in ("default", "avx2"):
        env = os.environ | {"ATEN_CPU_CAPABILITY": capability, "A3B_CACHE_DIR": str(tmp_path), "A3B_NO_NUMBA": "1"}
        out = tmp_path / f"{capability}.safetensors"
        run = subprocess.run([sys.executable, "-c", script, str(fixtures.moe_fused_bf16), str(out)],
                             capture_output=True, text=True, env=env, cwd=Path(__file__).parent.parent, timeout=300)
        assert run.returncode == 0, run.stderr
        used, folder = run.stdout.split()
        folders[used] = folder
        logits.append(load_file(out)["logits"])
    assert len(folders) == 2 and len(set(folders.values())) == 1, folders
    assert len(list(Path(folder).glob("*.safetensors"))) == 4  # written once, by the first load
    torch.testing.assert_close(logits[0], logits[1], atol=2e-2, rtol=0)


def test_converted_experts_are_cached_on_disk(fixtures, tmp_path, monkeypatch):
    monkeypatch.setenv("A3B_CACHE_DIR", str(tmp_path))
    ids = fixtures.refs(fixtures.moe_fused_bf16)["text.input_ids"]
    first = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32", weight_format="int4")
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == 4  # one per layer
    stamps = [f.stat().st_mtime_ns for f in files]
    second = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32", weight_format="int4")
    assert [f.stat().st_mtime_ns for f in files] == stamps  # read, not rewritten
    assert torch.equal(first.logits(ids), second.logits(ids))
    assert not list(tmp_path.rglob("*.tmp"))
