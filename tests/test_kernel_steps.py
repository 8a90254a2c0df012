"""The decoding kernels besides the routed experts (step_kernels.py, cpu_numba.py): dense products of few
rows and the Gated DeltaNet step equal the torch computations they replace, MoE blocks' and decoder layers' one-call
steps equal their paths with the separate kernels; they are attached to bf16 models only, and whole models decode the
same with them."""
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from a3b_core import load_model
from a3b_core.formats.dense import QuantizedLinear
from a3b_core.formats.kernel_stores import compiled_kernels, kernels_enabled
from a3b_core.formats.int4 import TorchInt4Stack
from a3b_core.kernels.arrays import BlockExperts, BlockMatrix
from a3b_core.kernels.cpu_linear import CpuLinear, FusedLinear, linear
from a3b_core.models.layers import RMSNorm, rotary_cos_sin
from a3b_core.models.qwen3_5.cache import Cache
from a3b_core.models.qwen3_5.config import parse_text_config
from a3b_core.models.qwen3_5.text import GatedDeltaNet, SparseMoE
from a3b_core.runtime import layer_steps
from a3b_core.runtime import step_kernels as kernel_steps
from a3b_core.runtime.layer_steps import AttentionLayerKernel, DeltaNetKernel, DeltaNetLayerKernel, MoeStepKernel
from a3b_core.runtime.row_kernels import DenseKernel, NormKernel
from a3b_core.runtime.step_kernels import BF16_KERNEL_MIN_ROWS, attach_step_kernels
from tests.test_cpu_kernels import step_bound

pytestmark = pytest.mark.skipif(compiled_kernels() is None, reason="numba is not installed or cannot compile")

EXACT_BOUND = 1e-5  # fp32 sums against fp64, as a fraction of the largest |output|


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("rows", [1, 2])
def test_dense_products_equal_the_exact_product(rows, one_thread):
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 256, generator=g).bfloat16(), torch.randn(300, generator=g)
    x = torch.randn(1, rows, 256, generator=g)
    want = x.double() @ weight.double().t()
    bf16 = CpuLinear(torch.nn.Parameter(weight), torch.nn.Parameter(bias))
    bf16.rows_kernel = DenseKernel("bf16", weight[None], compiled_kernels())
    assert relative_error(bf16(x), want + bias.double()) < EXACT_BOUND
    assert bf16(x.bfloat16()).dtype == torch.bfloat16
    fused = FusedLinear([weight[:100], weight[100:]])
    fused.rows_kernel = DenseKernel("bf16", fused.weight[None], compiled_kernels())
    parts = fused(x)
    assert [p.shape[-1] for p in parts] == [100, 200] and relative_error(torch.cat(parts, -1), want) < EXACT_BOUND
    for fmt, inputs in (("int8", 256), ("int4", 256), ("int4", 96)):  # int4 groups of 128, and of 32
        quantized = QuantizedLinear(fmt, weight[:, :inputs].float())
        quantized.rows_kernel = DenseKernel(fmt, quantized.matrix, compiled_kernels())
        exact = x[..., :inputs].double() @ quantized.matrix.dequantize(0).double().t()
        assert relative_error(quantized(x[..., :inputs]), exact) < step_bound(fmt)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantised_products_of_many_rows_use_the_dequantised_weights(fmt, one_thread):
    """A prefill's rows: torch's fp32 product of the kernel's dequantized matrix (the store's own weights)."""
    g = torch.Generator().manual_seed(0)
    quantized = QuantizedLinear(fmt, torch.randn(300, 256, generator=g))
    quantized.rows_kernel = DenseKernel(fmt, quantized.matrix, compiled_kernels())
    x = torch.randn(2, 5, 256, generator=g)
    got = quantized(x)
    assert got.shape == (2, 5, 300)
    assert relative_error(got, x.double() @ quantized.matrix.dequantize(0).double().t()) < EXACT_BOUND


def test_a_dense_rows_result_does_not_depend_on_the_other_row(one_thread):
    weight = torch.randn(256, 128).bfloat16()
    layer = CpuLinear(torch.nn.Parameter(weight))
    layer.rows_kernel = DenseKernel("bf16", weight[None], compiled_kernels())
    x = torch.randn(2, 128).bfloat16()
    assert torch.equal(layer(x)[:1], layer(x[:1]))


def test_more_rows_take_torchs_products(one_thread):
    weight = torch.randn(256, 128).bfloat16()
    layer = CpuLinear(torch.nn.Parameter(weight))
    layer.rows_kernel = DenseKernel("bf16", weight[None], compiled_kernels())
    x = torch.randn(3, 128).bfloat16()
    assert torch.equal(layer(x), linear(x, weight))


def deltanet_layer(key_heads: int, value_heads: int) -> GatedDeltaNet:
    """A Gated DeltaNet layer with random fp32 parameters (heads of 32)."""
    cfg = parse_text_config(dict(
        vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=32,
        layer_types=["linear_attention"], linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=0,
        intermediate_size=64, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                                      partial_rotary_factor=0.5)), "test", False)
    layer = GatedDeltaNet(cfg, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        layer.norm.weight.add_(1)
    return layer


@pytest.mark.parametrize("heads", [(2, 4), (2, 2)])
def test_deltanet_step_equals_torchs(heads, one_thread):
    """Decoding steps of two sequences after a prefill: the layer's output, its conv history and its recurrent state
    with the kernel equal torch's step's (the same fp32 computation)."""
    layer = deltanet_layer(*heads)
    caches = [Cache(layer.cfg, 2, 16) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 64, generator=g)
    with torch.no_grad():
        for cache in caches:
            layer(x, cache)
        for _ in range(4):
            x = torch.randn(2, 1, 64, generator=g)
            layer.step_kernel = None
            want = layer(x, caches[0])
            layer.step_kernel = DeltaNetKernel(layer, compiled_kernels())
            assert relative_error(layer(x, caches[1]), want) < EXACT_BOUND
    assert relative_error(caches[1].state[0], caches[0].state[0]) < EXACT_BOUND
    assert torch.equal(caches[1].conv[0], caches[0].conv[0])


def test_deltanet_step_leaves_a_fake_cache_to_torch():
    layer = deltanet_layer(2, 4)
    layer.step_kernel = DeltaNetKernel(layer, compiled_kernels())
    with FakeTensorMode(allow_non_fake_inputs=True):
        cache = Cache(layer.cfg, 1, 16)
        assert not layer.step_kernel.takes(cache.conv[0], cache.state[0])
        assert layer(torch.randn(1, 1, 64), cache).shape == (1, 1, 64)  # torch's step


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_kernel_rounds_torchs_norm(offset, one_thread):
    """A decoding step's bf16 rows (a layer's [B, 1, H], a head norm's [B, 1, heads, D]) normalize to torch's result
    within one bf16 rounding; other dtypes and a prefill's rows keep torch's norm."""
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6, offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    kernel = NormKernel(norm, compiled_kernels())
    for x in (torch.randn(2, 1, 96, generator=g).bfloat16() * 5, torch.randn(2, 1, 4, 96, generator=g).bfloat16()):
        want = norm(x)
        norm.norm_kernel = kernel
        got = norm(x)
        norm.norm_kernel = None
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -8).all()
        assert got.data_ptr() % 64 == 0  # torch's allocation: its int8 weight-only product crashes on numpy's
    assert not kernel.takes(torch.randn(2, 1, 96)) and not kernel.takes(torch.randn(1, 3, 96).bfloat16())


def coded_choice(name: str, shape: tuple[int, ...]) -> str | None:
    """A GGUF quantization of the types the kernels multiply in integers, as a Q4_K_M mixes them: Q4_K where rows
    hold whole 256-weight blocks, else Q8_0; Q6_K for the output projections; routers, norms and small vectors kept."""
    if len(shape) < 2 or name.endswith(("norm.weight", "ssm_conv1d.weight", "ffn_gate_inp.weight", "token_embd.weight",
                                        "ssm_alpha.weight", "ssm_beta.weight", "ffn_gate_inp_shexp.weight")):
        return None
    if shape[-1] % 256:
        return "Q8_0"
    return "Q6_K" if name.endswith(("attn_output.weight", "ssm_out.weight")) else "Q4_K"


@pytest.fixture(scope="module")
def coded_gguf(ggufs, tmp_path_factory) -> Path:
    """The converter's F32 Qwen3.5 MoE GGUF in Q4_K, Q6_K and Q8_0 blocks (coded_choice)."""
    from tests.quantized_gguf import requantize
    path = tmp_path_factory.mktemp("coded") / "moe_coded.gguf"
    requantize(ggufs.moe_f32, path, coded_choice)
    return path


def checkpoint(request: pytest.FixtureRequest, which: str) -> Path:
    """A fixture checkpoint by name: a GGUF file's fixture (coded_gguf) or a folder of tests/tiny_models.py."""
    return request.getfixturevalue(which) if which.endswith("gguf") else getattr(request.getfixturevalue("fixtures"),
                                                                                 which)


# (checkpoint, routed experts' format, dense_format): bf16, int8, int4 and FP8 experts; a fused bf16 projection
# (bf16 shared expert) and dense int8 / int4 shared experts; a GGUF file's blocks, dense matrices too
MOE_STEP_CASES = [("moe_fused_bf16", "bf16", "auto"), ("moe_fused_bf16", "int8", "int8"),
                  ("moe_fused_bf16", "int4", "int4"), ("moe_fp8", "fp8", "int8"), ("coded_gguf", "gguf", "auto")]


@pytest.mark.parametrize("which, weight_format, dense_format", MOE_STEP_CASES)
def test_moe_step_equals_the_blocks_kernel_path(request, which, weight_format, dense_format, monkeypatch,
                                                one_thread):
    """Each MoE block's one-call step of two decoding rows equals the block's own path with the dense and routed
    kernels (what it replaces) within one bf16 rounding (measured: equal; the step's exp is not torch's)."""
    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)
    model = load_model(checkpoint(request, which), preset="cpu", compute_dtype="bfloat16",
                       weight_format=weight_format, dense_format=dense_format)
    blocks = [m for m in model.text.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(isinstance(b.step_kernel, MoeStepKernel) for b in blocks)
    if weight_format == "gguf":  # the experts and the shared expert's matrices in their blocks
        assert all(isinstance(b.step_kernel.weights.experts, BlockExperts)
                   and isinstance(b.step_kernel.weights.down, BlockMatrix) for b in blocks)
    x = torch.randn(2, 1, model.text.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        for block in blocks:
            got = block(x)
            kernel, block.step_kernel = block.step_kernel, None
            want = block(x)
            block.step_kernel = kernel
            assert got.dtype == torch.bfloat16 and got.shape == x.shape
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -8).all()


@pytest.mark.parametrize("which, weight_format, dense_format", MOE_STEP_CASES)
def test_layer_steps_equal_the_layers_kernel_path(request, which, weight_format, dense_format, monkeypatch,
                                                  one_thread):
    """Each decoder layer's one-call step of two decoding rows returns what the layer's own path with the separate
    kernels returns (within the effect of one bf16 rounding: products torch computes there, attention among them, are
    summed in the kernels' order), and leaves the same cache: DeltaNet conv history and state, attention keys and
    values."""
    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)
    model = load_model(checkpoint(request, which), preset="cpu", compute_dtype="bfloat16",
                       weight_format=weight_format, dense_format=dense_format)
    cfg = model.text.cfg
    kinds = [type(layer.step_kernel) for layer in model.text.layers]
    assert kinds == [AttentionLayerKernel if kind == "full_attention" else DeltaNetLayerKernel
                     for kind in cfg.layer_types]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, cfg.hidden_size, generator=g).bfloat16()
    cached = 5
    caches = [model.new_cache(2, cached + 1) for _ in range(2)]
    for name in ("conv", "state", "keys", "values"):  # the same random state and cached tokens in both
        for layer, t in getattr(caches[0], name).items():
            getattr(caches[1], name)[layer].copy_(t.copy_(torch.randn(t.shape, generator=g) * 0.1))
    for cache in caches:
        cache.extend_mask(None, cached)
        cache.advance(cached)
        cache.extend_mask(None, 1)
    cos, sin = rotary_cos_sin(cfg, torch.full((3, 2, 1), cached))
    with torch.no_grad():
        for layer in model.text.layers:
            got = layer(x, cos, sin, caches[0], None, None)
            kernel, layer.step_kernel = layer.step_kernel, None
            want = layer(x, cos, sin, caches[1], None, None)
            layer.step_kernel = kernel
            assert got.dtype == torch.bfloat16 and got.shape == x.shape
            # measured: DeltaNet layers equal; attention layers 27 of 256 values one bf16 rounding apart, at most
            # 2.2e-3 of the largest |value|
            assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7
    for name in ("conv", "state", "keys", "values"):
        for layer, t in getattr(caches[0], name).items():
            assert torch.allclose(t.float(), getattr(caches[1], name)[layer].float(), rtol=1e-5, atol=1e-6)
    attention = [layer.step_kernel for layer in model.text.layers if hasattr(layer, "self_attn")]
    assert all(kernel.takes(x, caches[0], None) for kernel in attention)
    monkeypatch.setattr(layer_steps, "LAYER_ATTENTION_MAX", cached * attention[0].token_work)  # one token short
    assert not any(kernel.takes(x, caches[0], None) for kernel in attention)


def test_attention_over_many_key_blocks_equals_softmax_attention(one_thread):
    """The layer step's attention (cpu_numba.attend_cached) over cached tokens in several KEY_BLOCKs, the last one
    partial, with query heads sharing KV heads: each block's softmax sums combined equal one softmax over all."""
    g = torch.Generator().manual_seed(0)
    tokens, kv_heads, group, dim, length = 2, 2, 3, 64, 2 * compiled_kernels().KEY_BLOCK + 88
    keys, values = (torch.randn(tokens, kv_heads, length + 5, dim, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(tokens * kv_heads * group, dim, generator=g) * 2
    out = torch.empty(tokens, kv_heads * group * dim)
    compiled_kernels().attend_cached(q.numpy(), keys.view(torch.int16).numpy(), values.view(torch.int16).numpy(),
                                     length, group, out.numpy())
    k, v = (t[:, :, :length].double().repeat_interleave(group, dim=1) for t in (keys, values))  # [T, heads, L, D]
    scores = q.double().view(tokens, kv_heads * group, 1, dim) @ k.transpose(-1, -2) * dim ** -0.5
    want = (torch.softmax(scores, dim=-1) @ v).view(tokens, -1)
    assert relative_error(out, want) < EXACT_BOUND


def attached(model) -> Counter:
    """How many of each kernel a model's text model has attached (rows_kernel, step_kernel, norm_kernel)."""
    return Counter(type(kernel).__name__ for module in model.text.modules()
                   for kernel in (getattr(module, a, None) for a in ("rows_kernel", "step_kernel", "norm_kernel"))
                   if kernel is not None)


# bf16 models, kernels against torch's path (4 layers, logit std 0.57; the tiny models' bf16 matrices are below
# BF16_KERNEL_MIN_ROWS, so only dense int8 brings dense kernels): the kernels sum in fp32 where torch's bf16
# path rounds intermediates to bf16 (and torch's int8 kernel the activations). Measured: 0.043 on the MoE (torch's bf16
# path against the fp32 reference: 0.057), 0.031 on the MoE with dense int8, 0.024 with dense int4, below 0.001 on the
# dense model. Greedy:
# the MoE's tokens equal torch's; elsewhere a token differs where torch's own logits are a near tie (0.016, 0.055).
MODEL_LOGIT_BOUND = 0.15


@pytest.mark.parametrize("which, dense_format", [("moe_fused_bf16", "auto"), ("dense", "auto"),
                                                 ("moe_fused_bf16", "int8"), ("moe_fused_bf16", "int4")])
def test_bf16_models_decode_the_same_with_step_kernels(fixtures, which, dense_format, monkeypatch, one_thread):
    folder = getattr(fixtures, which)
    ids = fixtures.refs(folder)["text.input_ids"][:, :1]
    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)  # whatever the run's own setting
    with_kernels = load_model(folder, preset="cpu", compute_dtype="bfloat16", dense_format=dense_format)
    monkeypatch.setenv("A3B_NO_NUMBA", "1")
    torch_path = load_model(folder, preset="cpu", compute_dtype="bfloat16", dense_format=dense_format)
    kernels = attached(with_kernels)
    norms = sum(isinstance(m, RMSNorm) for m in with_kernels.text.modules())
    assert kernels["DeltaNetKernel"] == 3 and kernels["NormKernel"] == norms and not attached(torch_path)
    assert kernels["MoeStepKernel"] == (4 if which.startswith("moe") else 0)
    assert kernels["DeltaNetLayerKernel"] + kernels["AttentionLayerKernel"] == (4 if which.startswith("moe") else 0)
    assert (kernels["DenseKernel"] > 0) == (dense_format != "auto")
    assert (with_kernels.logits(ids).float() - torch_path.logits(ids).float()).abs().max() < MODEL_LOGIT_BOUND
    tokens = with_kernels.generate(ids[0], max_new_tokens=8, temperature=0).token_ids
    torch_logits = torch_path.logits(torch.cat([ids[0], torch.tensor(tokens)])[None])[0, ids.shape[1] - 1:-1].float()
    chosen = torch_logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (torch_logits.max(dim=1).values - chosen).max() < MODEL_LOGIT_BOUND


def test_kernels_skip_fp32_models_and_small_matrices(fixtures, monkeypatch):
    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)
    assert kernels_enabled()
    assert not attached(load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32"))
    fp32_int4 = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32", dense_format="int4")
    quantized = [m for m in fp32_int4.text.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(isinstance(m.matrix, TorchInt4Stack) for m in quantized)  # no kernel: torch's packing
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", dense_format="int8")
    for module in model.text.modules():
        if isinstance(module, QuantizedLinear):
            assert module.rows_kernel is not None
        elif isinstance(module, CpuLinear):
            assert (module.rows_kernel is not None) == (module.weight.shape[0] >= BF16_KERNEL_MIN_ROWS)
    text = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(4, 8).bfloat16()})
    with FakeTensorMode():
        text["proj"] = CpuLinear(torch.nn.Parameter(torch.empty(BF16_KERNEL_MIN_ROWS, 8, dtype=torch.bfloat16)))
    attach_step_kernels(text)
    assert text["proj"].rows_kernel is None  # fake weights: nothing numpy can read


def test_kernels_that_fail_their_check_leave_torchs_path(fixtures, monkeypatch):
    """A step kernel that does not compile or reproduce its small cases is found at load: a warning, and the model
    loads and decodes with torch's operations."""
    def broken(kernels):
        raise ValueError("a compile error")

    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)
    monkeypatch.setattr(kernel_steps, "check_step_kernels", broken)
    kernel_steps.checked_step_kernels.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not compile the CPU decoding kernels"):
            model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", dense_format="int8")
        assert not attached(model)
        assert 1 <= len(model.generate(torch.tensor([1, 2]), max_new_tokens=3, temperature=0).token_ids) <= 3
    finally:
        kernel_steps.checked_step_kernels.cache_clear()


def test_layer_steps_are_checked_once_per_kind_and_fall_back_when_the_check_fails(fixtures, monkeypatch):
    """One layer of each kind is checked at load (its verdict serves the layers with the same compiled signature); a
    layer step that fails its check leaves the layers' path with the separate kernels, with a warning."""
    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)
    checked = []
    reproduces = layer_steps.layer_step_reproduces
    monkeypatch.setattr(layer_steps, "layer_step_reproduces",
                        lambda kernel, layer: checked.append(type(kernel)) or reproduces(kernel, layer))
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16")
    assert sorted(k.__name__ for k in checked) == ["AttentionLayerKernel", "DeltaNetLayerKernel"]
    assert all(layer.step_kernel is not None for layer in model.text.layers)

    def broken(layer, rows):
        raise ValueError("a compile error")

    monkeypatch.setattr(layer_steps, "check_cache", broken)
    with pytest.warns(UserWarning, match="could not compile the CPU decoder layer step"):
        model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16")
    assert all(layer.step_kernel is None for layer in model.text.layers)
    assert isinstance(model.text.layers[0].mlp.step_kernel, MoeStepKernel)  # the parts keep their kernels
    assert 1 <= len(model.generate(torch.tensor([1, 2]), max_new_tokens=3, temperature=0).token_ids) <= 3


def test_importing_the_engine_leaves_numba_unimported():
    """numba is imported where the kernels are first compiled, not with the engine or a family's model code (the
    fused steps in models/qwen3_5/cpu_steps.py included): a model loads without it."""
    code = "import sys, a3b_core, a3b_core.runtime.step_kernels, a3b_core.models.qwen3_5; print('numba' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[1])
    assert found.stdout.strip() == "False"


# a one-matrix product in a child process run on a copy of the package (see package_copy)
MATRIX = ("import sys\n"
          "import numpy as np\n"
          "from a3b_core.kernels.arrays import BF16, Matrix\n"
          "matrix = Matrix(BF16, np.zeros((1, 1, 4, 8), np.int16), np.zeros((0, 0, 0), np.float32))\n"
          "rows = np.ones((2, 8), np.float32)\n")


def package_copy(tmp_path: Path) -> dict[str, str]:
    """A copy of a3b_core in tmp_path with its own numba cache: the environment for child processes run there."""
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "a3b_core", tmp_path / "a3b_core", ignore=shutil.ignore_patterns("__pycache__", "demo"))
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"NUMBA_CACHE_DIR": str(tmp_path / "cache")}


def test_fused_steps_compile_again_when_the_generic_kernels_change(tmp_path):
    """numba stamps a kernel's disk cache with its own file only; Qwen3.5's fused steps compile cpu_numba.py's kernels
    in, so once cpu_numba.py changes (a newer pack) they compile again instead of loading their old copies."""
    env = package_copy(tmp_path)
    code = MATRIX + ("from a3b_core.models.qwen3_5 import cpu_steps\n"
                     "cpu_steps.product(matrix, rows)\n"
                     "print(sum(cpu_steps.product.stats.cache_hits.values()))")

    def loaded_from_cache() -> bool:
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                             check=True)
        return int(run.stdout.split()[-1]) > 0

    assert not loaded_from_cache() and loaded_from_cache()
    generic = tmp_path / "a3b_core" / "kernels" / "cpu_numba.py"
    generic.write_text(generic.read_text() + "\n# a changed generic kernel\n")
    assert not loaded_from_cache() and loaded_from_cache()


def test_fused_steps_compiled_against_cached_generic_kernels_load_in_a_new_process(tmp_path):
    """A process compiles a generic kernel that calls a parallel one (bf16_product, matrix_rows), the next loads it
    from the disk cache and compiles a fused step calling it (cpu_steps.product), a third loads that step: numba
    caches the step without the parallel kernel's hook that starts its thread pool, which importing cpu_numba.py
    starts instead, so every child exits 0 (on a copy of the package, its own NUMBA_CACHE_DIR)."""
    env = package_copy(tmp_path)
    code = MATRIX + ("if sys.argv[1] == 'generic':\n"
                     "    from a3b_core.kernels import cpu_numba\n"
                     "    cpu_numba.bf16_product(matrix.code, matrix.q, matrix.scale, rows)\n"
                     "else:\n"
                     "    from a3b_core.models.qwen3_5 import cpu_steps\n"
                     "    cpu_steps.product(matrix, rows)\n")
    codes = [subprocess.run([sys.executable, "-c", code, kind], cwd=tmp_path, env=env, capture_output=True).returncode
             for kind in ("generic", "step", "step")]
    assert codes == [0, 0, 0]
