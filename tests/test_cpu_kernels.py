"""The CPU routed-expert kernel (formats/kernel_stores.py, kernels/cpu_numba.py): one call per layer equals the routed
step of the store it replaces, per format; whole models decode the same with it; A3B_NO_NUMBA=1 keeps torch's path."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from a3b_core import load_model
from a3b_core.formats.kernel_stores import (FORMAT_CODES, KernelExperts, compiled_kernels, dequantized, kernel_arrays,
                                            kernels_enabled, matrix, swap_in_kernels)
from a3b_core.formats.int4 import dequantize_int4, int4_group_size, quantize_int4
from a3b_core.formats.stores import CpuFloatExperts, QuantizedExperts
from a3b_core.models.layers import RoutedExperts
from tests.fake_cuda import FakeCuda

pytestmark = pytest.mark.skipif(compiled_kernels() is None, reason="numba is not installed or cannot compile")

EXPERTS, HIDDEN, INTER = 6, 256, 128
# Stated bounds, as a fraction of the largest |output|: the kernel against the fp64 step over the store's own
# dequantized weights (fp32 sums), and against torch's path, which rounds activations and products to bf16.
EXACT_BOUND = 1e-5
# int4 and int8 rows are multiplied by int16 codes of the activations (cpu_numba.coded_groups): each input is off by
# at most 1/65534 of its group's largest |x|. Measured 6e-5 here, where the formats' own rounding of the weights is
# 1.3e-2 (int8) and 0.26 (int4) against the unquantized weights.
CODES_BOUND = 2e-4
TORCH_PATH_BOUND = 2e-2


def step_bound(fmt: str) -> float:
    """The stated bound of a decoding step (one row at a time) in `fmt` against fp64 over the store's weights."""
    return CODES_BOUND if fmt in ("int4", "int8") else EXACT_BOUND


def make_store(fmt: str) -> QuantizedExperts | CpuFloatExperts:
    """A layer's experts in `fmt`: a quantized store, or bf16 float experts as loading places them on the CPU."""
    g = torch.Generator().manual_seed(0)
    if fmt == "bf16":
        return CpuFloatExperts(*(torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16() * 0.05)
                                 for shape in ((EXPERTS, 2 * INTER, HIDDEN), (EXPERTS, HIDDEN, INTER))))
    store = QuantizedExperts(fmt, EXPERTS, HIDDEN, INTER)
    for e in range(EXPERTS):
        store.gate_up_proj.set(e, torch.randn(2 * INTER, HIDDEN, generator=g) * 0.05)
        store.down_proj.set(e, torch.randn(HIDDEN, INTER, generator=g) * 0.05)
    return store


def routing(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, H], and top-2 routings in which rows share experts, weights a softmax over the two (summing to 1)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, HIDDEN, generator=g)
    top_i = torch.tensor([[1, 4], [4, 0], [1, 5]])[:rows]
    top_p = torch.softmax(torch.randn(rows, 2, generator=g), dim=-1)
    return x, top_i, top_p


def fp64_step(store: QuantizedExperts | CpuFloatExperts, x: torch.Tensor, top_i: torch.Tensor,
              top_p: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(top_i[t].tolist(), top_p[t].tolist()):
            gate, up = (matrix(store.gate_up_proj, e).double() @ x[t].double()).chunk(2)
            out[t] += w * matrix(store.down_proj, e).double() @ (F.silu(gate) * up)
    return out


def moe_layer(experts: torch.nn.Module) -> RoutedExperts:
    cfg = SimpleNamespace(hidden_size=HIDDEN, num_experts=EXPERTS, moe_intermediate_size=INTER, num_experts_per_tok=2)
    layer = RoutedExperts(cfg)
    layer.experts = experts
    return layer


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "bf16"])
def test_kernel_step_equals_the_stores_step(fmt, rows, one_thread):
    store = make_store(fmt)
    x, top_i, top_p = routing(rows)
    kernel = KernelExperts(store, compiled_kernels())
    got = kernel.routed_step(x, top_i, top_p)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert relative_error(got, fp64_step(store, x, top_i, top_p)) < step_bound(fmt)
    torch_path = moe_layer(store).routed_experts(x, top_i, top_p)
    assert relative_error(got, torch_path) < TORCH_PATH_BOUND
    decoded = moe_layer(kernel).routed_experts(x, top_i, top_p, decoding=True)
    assert relative_error(decoded, torch_path) < TORCH_PATH_BOUND


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_the_other_rows(threads, fmt):
    """A batch decodes each sequence as it would decode alone, to the bit."""
    store = make_store(fmt)
    x, top_i, top_p = routing(3)
    kernel = KernelExperts(store, compiled_kernels())
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernel.routed_step(x, top_i, top_p)
        alone = [kernel.routed_step(x[i:i + 1], top_i[i:i + 1], top_p[i:i + 1]) for i in range(3)]
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "bf16"])
def test_prefill_multiplies_the_stores_own_weights(fmt, one_thread):
    """Prefill (many rows): bf16 experts take the store's products; quantized ones take torch's fp32 product of
    the kernel's dequantized matrices, which are the store's own to the bit."""
    store = make_store(fmt)
    rows = 12
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(2))
    top_i = torch.arange(2 * rows).view(rows, 2) % EXPERTS
    top_p = torch.full((rows, 2), 0.5)
    kernel = KernelExperts(store, compiled_kernels())
    got = moe_layer(kernel).routed_experts(x, top_i, top_p)
    if fmt == "bf16":
        assert torch.equal(got, moe_layer(store).routed_experts(x, top_i, top_p))
        return
    assert relative_error(got, fp64_step(store, x, top_i, top_p)) < EXACT_BOUND
    for matrices, stack in ((kernel.gate_up_proj, store.gate_up_proj), (kernel.down_proj, store.down_proj)):
        for e in range(EXPERTS):
            for dtype in (torch.float32, torch.bfloat16):
                weight = dequantized(compiled_kernels(), FORMAT_CODES[fmt], matrices.arrays, matrices.shape[1:], e,
                                     dtype)
                assert torch.equal(weight, stack.dequantize(e).to(dtype))


def test_bf16_dequantising_rounds_as_torch_does():
    """Weights k * (1 + 2^-8) for every int8 k, negative ones too: those of k = ±1 and ±2 lie exactly halfway between
    two bf16 values, where torch rounds to the even one."""
    q = torch.arange(-127, 128, dtype=torch.int8).repeat(3, 1)  # [rows, in]
    scale = torch.full((1, 3, 1), 1 + 2 ** -8)
    out = torch.empty(3, 255, dtype=torch.bfloat16)
    compiled_kernels().dequantize_bf16(FORMAT_CODES["int8"], q.numpy()[None, None], scale.numpy(), 0,
                                       out.view(torch.int16).numpy())
    assert torch.equal(out, (q.float() * scale[0]).bfloat16())


def kernel_stores(model) -> int:
    return sum(isinstance(m, KernelExperts) for m in model.text.modules())


# Whole tiny models (4 layers, logit std 0.57), kernel against torch's path on the same quantized weights, fp32
# compute: the largest |logit difference| for two one-token prompts (a decoding step of two rows), and greedy decoding.
# Measured: int8 0.018-0.026, int4 0.022 (torch's int8 and int4 kernels take bf16 activations, and torch's int4
# packing rounds the scales and minimums to bf16), fp8 below 1e-4. In greedy decoding int4's kernel picks a token
# 0.13 below torch's best at one near tie.
MODEL_LOGIT_BOUNDS = {"int8": 0.1, "int4": 0.2, "fp8": 0.1}


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_models_decode_the_same_with_kernels(fixtures, fmt, monkeypatch, one_thread):
    folder = fixtures.moe_fp8 if fmt == "fp8" else fixtures.moe_fused_bf16
    ids = fixtures.refs(folder)["text.input_ids"][:, :1]
    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)  # whatever the run's own setting
    with_kernels = load_model(folder, preset="cpu", compute_dtype="float32", weight_format=fmt)
    monkeypatch.setenv("A3B_NO_NUMBA", "1")
    assert not kernels_enabled()
    torch_path = load_model(folder, preset="cpu", compute_dtype="float32", weight_format=fmt)
    assert kernel_stores(with_kernels) == len(with_kernels.text.layers) and kernel_stores(torch_path) == 0
    assert (with_kernels.logits(ids) - torch_path.logits(ids)).abs().max() < MODEL_LOGIT_BOUNDS[fmt]
    # each greedy token of the kernel is torch's greedy token at that point, or within the bound of its logit (a
    # near tie that rounding may flip)
    tokens = with_kernels.generate(ids[0], max_new_tokens=8, temperature=0).token_ids
    pads = {with_kernels.config.image_token_id, with_kernels.config.video_token_id}  # a prompt holds them for media
    tokens = tokens[:next((i for i, t in enumerate(tokens) if t in pads), len(tokens))]
    torch_logits = torch_path.logits(torch.cat([ids[0], torch.tensor(tokens)])[None])[0, ids.shape[1] - 1:-1]
    chosen = torch_logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (torch_logits.max(dim=1).values - chosen).max() < MODEL_LOGIT_BOUNDS[fmt]


def test_bf16_experts_with_kernels_compute_as_the_float32_reference(fixtures, monkeypatch, one_thread):
    """bf16 experts of a BF16 release hold its weights exactly, and the kernel sums in fp32 without rounding the
    activations to bf16 (torch's bf16 products do, which flips a router choice of this model: 0.58 off in a logit),
    so with fp32 compute it gives the fp32 reference's logits and greedy tokens."""
    folder = fixtures.moe_fused_bf16
    ids = fixtures.refs(folder)["text.input_ids"][:, :1]
    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)  # whatever the run's own setting
    with_kernels = load_model(folder, preset="cpu", compute_dtype="float32", weight_format="bf16")
    reference = load_model(folder, preset="cpu", compute_dtype="float32")
    assert kernel_stores(with_kernels) == len(with_kernels.text.layers) and kernel_stores(reference) == 0
    assert (with_kernels.logits(ids) - reference.logits(ids)).abs().max() < 1e-4
    assert (with_kernels.generate(ids[0], max_new_tokens=8, temperature=0).token_ids
            == reference.generate(ids[0], max_new_tokens=8, temperature=0).token_ids)


def test_bfloat16_rows_come_back_in_bfloat16(one_thread):
    store = make_store("int8")
    x, top_i, top_p = routing(3)
    got = KernelExperts(store, compiled_kernels()).routed_step(x.bfloat16(), top_i, top_p.bfloat16())
    assert got.dtype == torch.bfloat16
    assert relative_error(got, fp64_step(store, x.bfloat16().float(), top_i, top_p.bfloat16().float())) < 2 ** -7


def test_float32_reference_path_has_no_kernels(fixtures, monkeypatch):
    monkeypatch.delenv("A3B_NO_NUMBA", raising=False)  # whatever the run's own setting
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32")
    assert kernels_enabled() and kernel_stores(model) == 0


def test_rows_without_data_take_the_stores_products(one_thread):
    """Fake rows (torch's fake tensors: shapes and devices, no data, as when a model is checked on a stand-in GPU)
    have nothing numpy can read: a decoding step computes them with the store's torch products, which take them."""
    store = make_store("int8")
    x, top_i, top_p = routing(3)
    layer = moe_layer(KernelExperts(store, compiled_kernels()))
    for rows in (1, 3):
        with FakeCuda() as stand_in:  # reads of the routing on the host are answered, as on a stand-in GPU
            out = layer.routed_experts(stand_in.fake.from_tensor(x[:rows]), top_i[:rows], top_p[:rows],
                                       decoding=True)
        assert isinstance(out, FakeTensor) and out.shape == (rows, HIDDEN)


def test_stores_without_data_keep_the_torch_path():
    """Expert stores made of fake tensors (a model's shapes checked without its weights) are not swapped."""
    with FakeTensorMode():
        text = torch.nn.ModuleDict({"experts": QuantizedExperts("int8", EXPERTS, HIDDEN, INTER)})
        swap_in_kernels(text)
    assert isinstance(text["experts"], QuantizedExperts)


def test_every_fp8_code_reads_as_torchs_e4m3(one_thread):
    """The kernel turns e4m3 bytes into floats by shifting bits: every code but NaN's (subnormals, both signs,
    the largest) gives torch's value."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn's NaN codes, which no released checkpoint holds
    store = QuantizedExperts("fp8", EXPERTS, HIDDEN, INTER)
    for stack in (store.gate_up_proj, store.down_proj):
        _, out, inp = stack.shape
        for e in range(EXPERTS):
            order = torch.randperm(out * inp, generator=torch.Generator().manual_seed(e)) % len(codes)
            q = codes[order].view(torch.float8_e4m3fn).view(out, inp)
            stack.set_released(e, q, torch.full(stack.scale.shape[1:], 2.0 ** -8))
    x, top_i, top_p = routing(3)
    got = KernelExperts(store, compiled_kernels()).routed_step(x, top_i, top_p)
    assert relative_error(got, fp64_step(store, x, top_i, top_p)) < EXACT_BOUND


def test_fp8_partial_scale_blocks(one_thread):
    """FP8 matrices whose sides are not multiples of 128 (the last scale block partial in both directions): the routed
    step and the dequantized matrices equal the store's own weights, as whole blocks do."""
    hidden, inter = 200, 72  # gate_up [144, 200]: one whole block and a partial one; down [200, 72]: one partial
    g = torch.Generator().manual_seed(3)
    store = QuantizedExperts("fp8", EXPERTS, hidden, inter)
    for e in range(EXPERTS):
        store.gate_up_proj.set(e, torch.randn(2 * inter, hidden, generator=g) * 0.05)
        store.down_proj.set(e, torch.randn(hidden, inter, generator=g) * 0.05)
    x = torch.randn(3, hidden, generator=g)
    _, top_i, top_p = routing(3)
    kernel = KernelExperts(store, compiled_kernels())
    assert relative_error(kernel.routed_step(x, top_i, top_p), fp64_step(store, x, top_i, top_p)) < EXACT_BOUND
    for matrices, stack in ((kernel.gate_up_proj, store.gate_up_proj), (kernel.down_proj, store.down_proj)):
        for e in range(EXPERTS):
            weight = dequantized(compiled_kernels(), FORMAT_CODES["fp8"], matrices.arrays, matrices.shape[1:], e,
                                 torch.float32)
            assert torch.equal(weight, stack.dequantize(e).float())


def test_int4_codes_of_zero_tiny_and_non_finite_activations(one_thread):
    """int4 rows multiply int16 codes of each group of activations: a group of zeros, a group of tiny values (coded
    at their own scale, not the row's) and a large group step within the bound; an inf or a NaN activation makes the
    row NaN, as fp32 products would."""
    store = make_store("int4")
    x, top_i, top_p = routing(3)
    x[0, :128] = 0
    x[1, :128] *= 1e-6
    x[1, 128:] *= 1e4
    kernel = KernelExperts(store, compiled_kernels())
    assert relative_error(kernel.routed_step(x[:2], top_i[:2], top_p[:2])[1:],
                          fp64_step(store, x[1:2], top_i[1:2], top_p[1:2])) < CODES_BOUND
    assert relative_error(kernel.routed_step(x[:1], top_i[:1], top_p[:1]),
                          fp64_step(store, x[:1], top_i[:1], top_p[:1])) < CODES_BOUND
    for bad in (float("inf"), float("nan")):
        x[2, 5] = bad
        out = kernel.routed_step(x, top_i, top_p)
        assert out[2].isnan().all() and out[:2].isfinite().all()


def rows_compiled_at(lanes: int, fmt: int, monkeypatch):
    """A function computing row_dot for every row of one matrix (q, scale as the kernels read them; x [1, in]) into
    out, compiled afresh with `lanes`-wide pmaddwd (0: the plain loops), or a skip where the CPU cannot run it."""
    from numba import njit

    from a3b_core.kernels import cpu_numba as ck
    if lanes > ck.PMADD_LANES:
        pytest.skip(f"this CPU's numba target has no {lanes}-lane pmaddwd")
    monkeypatch.setattr(ck, "PMADD_LANES", lanes)
    monkeypatch.setattr(ck, "int4_row", ck.pmadd_or_loop_int4_row if lanes else ck.loop_int4_row)
    monkeypatch.setattr(ck, "int8_row", ck.pmadd_int8_row if lanes else ck.loop_int8_row)

    @njit  # not cached: compiled with the width set above (row_dot, int4_row and int8_row are inlined into it)
    def rows(q, scale, x, out):
        extras, codes = ck.row_extras(fmt, scale, x)
        for r in range(q.shape[2]):
            out[r] = ck.row_dot(fmt, q, scale, 0, r, x[0], extras[0], codes[0])
    return rows


@pytest.mark.parametrize("lanes", [32, 16, 0])
@pytest.mark.parametrize("inputs", [256, 192, 96])  # groups of 128, 64 and 32 inputs
def test_int4_rows_at_each_group_size_and_vector_width(inputs, lanes, monkeypatch):
    """int4 rows against fp64 over their dequantized weights, for each group size and each code of the products:
    pmaddwd on 32 lanes (AVX-512) or 16 (AVX2), or LLVM's vectorizing of the plain loop. A row of nibbles of 15 times
    activations coded as 32767 sums without overflow."""
    rows = rows_compiled_at(lanes, FORMAT_CODES["int4"], monkeypatch)
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(24, inputs, generator=g)
    packed, scale_min = quantize_int4(weights, int4_group_size(inputs))
    packed[-1] = 0xFF  # every nibble 15, its groups' scale 1 and minimum 0
    scale_min[-1] = torch.tensor([1.0, 0.0])
    x = torch.randn(1, inputs, generator=g)
    for activations in (x, torch.ones(1, inputs)):
        out = torch.empty(24)
        rows(packed[None, None].numpy(), scale_min.reshape(1, 24, -1).numpy(), activations.numpy(), out.numpy())
        want = dequantize_int4(packed, scale_min).double() @ activations[0].double()
        assert relative_error(out, want) < CODES_BOUND
    assert out[-1].item() == 15 * inputs


@pytest.mark.parametrize("lanes", [32, 16, 0])
@pytest.mark.parametrize("inputs", [1024, 384, 96])  # coded in two column chunks, in one; not coded (not whole groups)
def test_int8_rows_at_each_vector_width(inputs, lanes, monkeypatch):
    """int8 rows against fp64 over their weights, in each code of the products: rows of whole groups of 128 inputs
    multiply int16 codes of the activations (pmaddwd on 32 or 16 lanes, or the plain integer loop), other rows fp32
    activations. Rows of 127 and -127 times activations coded as 32767 sum without overflow."""
    rows = rows_compiled_at(lanes, FORMAT_CODES["int8"], monkeypatch)
    g = torch.Generator().manual_seed(4)
    weights = torch.randn(24, inputs, generator=g)
    weights[-2], weights[-1] = 1.0, -1.0  # quantized to rows of 127 and of -127
    stack = QuantizedExperts("int8", 1, inputs, 12).gate_up_proj
    stack.set(0, weights)
    q, scale = kernel_arrays(stack)
    assert q[0, :, -1].min() == -127 and (q.shape[1] == 2) == (inputs == 1024)
    for activations in (torch.randn(1, inputs, generator=g), torch.ones(1, inputs)):
        out = torch.empty(24)
        rows(q, scale, activations.numpy(), out.numpy())
        want = stack.dequantize(0).double() @ activations[0].double()
        assert relative_error(out, want) < CODES_BOUND
    assert abs(out[-1].item() / want[-1].item() - 1) < 1e-6
