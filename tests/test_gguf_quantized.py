"""Block-quantized GGUF files (Q8_0 from llama.cpp's converter; every type the engine computes, written from the F32
fixtures by tests/quantized_gguf.py): the routed experts stay in the file's blocks and give the logits of the same
file dequantized by gguf-py, the planner keeps them and names their types, and other types are refused by name."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from a3b_core import load_model
from a3b_core.errors import A3BError, CheckpointError
from a3b_core.formats.dense import QuantizedLinear
from a3b_core.formats.stores import QuantizedExperts
from a3b_core.kernels.gguf_blocks import product_bound
from a3b_core.release.gguf import GGUFCheckpoint
from tests.tiny_gguf import build_gguf_fixtures
from tests.tiny_models import TEXT_PROMPT

gguf = pytest.importorskip("gguf", reason="the gguf package (requirements.txt) is not installed")
from tests.quantized_gguf import requantize  # noqa: E402  (needs gguf)

GATE = ["Q4_0", "IQ4_NL", "Q5_0", "Q4_1"]  # per layer; up differs from gate in some layers (a matrix of two types)
UP = ["Q5_1", "Q8_0", "Q4_0", "Q4_1"]
DOWN = ["Q4_K", "IQ4_XS", "Q2_K", "Q3_K", "Q5_K", "Q6_K"]  # K types need rows of 256: the Qwen3.5 fixture's down matrices


def choose(name: str, shape: tuple[int, ...]) -> str | None:
    """A mixed quantization as llama.cpp's are: experts per layer as above, other matrices Q8_0 / Q4_0 / Q6_K."""
    match = re.match(r"blk\.(\d+)\.(.*)", name)
    if len(shape) < 2 or name.endswith(("norm.weight", "ssm_conv1d.weight", "ffn_gate_inp.weight")) or shape[-1] % 32:
        return None
    if match is None:
        return "Q4_0" if name == "token_embd.weight" else "Q8_0"
    layer, rest = int(match[1]), match[2]
    if rest == "ffn_down_exps.weight":
        return DOWN[layer % len(DOWN)] if shape[-1] % 256 == 0 else "Q5_1"
    if rest == "ffn_gate_exps.weight":
        return GATE[layer % len(GATE)]
    if rest == "ffn_up_exps.weight":
        return UP[layer % len(UP)]
    return "Q6_K" if shape[-1] % 256 == 0 else "Q8_0"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    files = build_gguf_fixtures()
    if files is None:
        pytest.skip("llama.cpp's converter (the llama-cpp-python 0.3.36 source package) could not be downloaded")
    out = tmp_path_factory.mktemp("quantized")
    made = {"converter_q8_0": files.moe_q8_0}
    for name in ("moe_f32", "vl_moe_f32"):
        made[name] = out / f"{name}_mixed.gguf"
        requantize(getattr(files, name), made[name], choose)
    return made


def logits(path: Path, weight_format: str, compute_dtype: str = "float32") -> tuple[torch.Tensor, object]:
    model = load_model(path, preset="cpu", compute_dtype=compute_dtype, weight_format=weight_format)
    ids = torch.tensor([model.tokenizer.encode(TEXT_PROMPT)])
    return model.logits(ids).float(), model


@pytest.mark.parametrize("name", ["moe_f32", "vl_moe_f32", "converter_q8_0"])
def test_experts_in_their_blocks_give_the_dequantized_files_logits(quantized, name, one_thread):
    blocks, model = logits(quantized[name], "gguf")
    dequantized, _ = logits(quantized[name], "fp32")  # every weight dequantized at load by gguf-py
    # Q4_K, Q6_K and Q8_0 products code the activations as int8, as llama.cpp does (gguf_blocks.product_bound): the
    # mixed file's logits measured 0.6% relative RMS from the dequantized ones, the others under 0.05%
    assert ((blocks - dequantized).norm() / dequantized.norm()).item() < 1.5e-2
    ckpt = GGUFCheckpoint(quantized[name])
    for index, layer in enumerate(model.text.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, QuantizedExperts) and experts.fmt == "gguf"
        base = f"model.language_model.layers.{index}.mlp.experts."
        # the blocks are the file's: as many bytes as its expert tensors, and the same
        stored = sum(ckpt.infos[base + which].nbytes for which in ("gate_up_proj", "down_proj"))
        assert experts.gate_up_proj.q.numel() + experts.down_proj.q.numel() == stored
        first = ckpt.blocks_at(base + "down_proj", 3)[0][1]
        assert torch.equal(experts.down_proj.q[3], first.reshape(-1))


def test_mixed_types_in_one_matrix_and_every_type_are_computed(quantized):
    ckpt = GGUFCheckpoint(quantized["moe_f32"])
    kinds = {str(t) for info in ckpt.infos.values() if "experts" in info.name
             for t, _ in ckpt.blocks_at(info.name, 0)}
    assert kinds == {*GATE, *UP, *DOWN[:4]}  # four layers: Q5_K and Q6_K are not among the downs
    parts = ckpt.blocks_at("model.language_model.layers.0.mlp.experts.gate_up_proj", 0)
    assert [str(t) for t, _ in parts] == ["Q4_0", "Q5_1"]


def test_auto_keeps_the_blocks_and_the_plan_names_their_types(quantized, one_thread):
    auto, model = logits(quantized["moe_f32"], "auto", "bfloat16")
    note = next(n for n in model.plan.notes if "CPU experts" in n)
    assert "GGUF file's blocks (IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q8_0)" in note
    assert model.text.layers[0].mlp.experts.fmt == "gguf"
    assert model.plan.dense_format == "gguf"
    assert any("dense parts" in n and "GGUF file's blocks (Q6_K, Q8_0)" in n for n in model.plan.notes)
    exact, _ = logits(quantized["moe_f32"], "fp32")  # the reference mode: every weight dequantized, fp32 throughout
    bf16, _ = logits(quantized["moe_f32"], "bf16", "bfloat16")  # a bf16 model: every weight dequantized to bf16

    def error(got: torch.Tensor) -> float:
        return ((got - exact).norm() / exact.norm()).item()

    # the tiny random model amplifies bf16's rounding: a bf16 model of these weights is 15% relative RMS from the
    # exact logits; the blocks (bf16 weights in products of many rows where oneDNN multiplies bf16, else fp32 ones)
    # measured 15% and 3.3%
    assert error(auto) < 1.2 * error(bf16)


@pytest.mark.parametrize("name", ["moe_f32", "vl_moe_f32"])
def test_dense_matrices_in_their_blocks_compute_the_releases_products(quantized, name, one_thread):
    """Every dense matrix kept in blocks multiplies as the release's matrix (the file dequantized by gguf-py, the
    converter's reorders undone): a DeltaNet output projection whose columns the converter reordered included."""
    model = load_model(quantized[name], preset="cpu", compute_dtype="bfloat16")
    ckpt = GGUFCheckpoint(quantized[name])
    kept = {"lm_head.weight" if n == "lm_head" else f"model.language_model.{n}.weight": m
            for n, m in model.text.named_modules() if isinstance(m, QuantizedLinear) and m.fmt == "gguf"}
    assert len(kept) >= 4 * len(model.text.layers)
    assert ("lm_head.weight" in kept) == ("lm_head.weight" in ckpt)  # untied: the file's output.weight
    reordered = [n for n, m in kept.items() if m.input_order is not None]
    assert reordered == ([] if name == "vl_moe_f32" else
                         [f"model.language_model.layers.{i}.linear_attn.out_proj.weight"
                          for i, layer in enumerate(model.text.layers) if hasattr(layer, "linear_attn")])
    assert any(kept[n].rows_kernel is not None for n in reordered) or not reordered  # the kernel reorders too
    g = torch.Generator().manual_seed(0)
    for source, module in kept.items():
        weight = ckpt.weight(source)
        for rows in (1, 2, 9):  # the kernel's products of few rows, and the fallback's of more
            x = torch.randn(rows, weight.shape[1], generator=g)
            want = x.double() @ weight.double().T
            order = slice(None) if module.input_order is None else module.input_order  # the kernel codes x so
            bound = product_bound(module.matrix.layout.parts[0][0].type_id, x[:, order].numpy(),
                                  weight[:, order].numpy(), exact=False)
            assert ((module(x).double() - want).abs().numpy() <= bound + 1e-6).all(), source


def test_other_formats_are_made_from_the_dequantized_blocks(quantized, one_thread):
    model = load_model(quantized["moe_f32"], preset="cpu", compute_dtype="float32", weight_format="int8")
    ckpt = GGUFCheckpoint(quantized["moe_f32"])
    experts = model.text.layers[0].mlp.experts
    assert experts.fmt == "int8"
    for which, product in (("gate_up_proj", experts.gate_up), ("down_proj", experts.down)):
        exact = torch.cat([torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), t.type_id))
                           for t, blocks in ckpt.blocks_at(f"model.language_model.layers.0.mlp.experts.{which}", 5)])
        weights = product(5, torch.eye(exact.shape[1])).t()  # the store's matrix, through its own product
        step = exact.abs().amax(1, keepdim=True) / 127  # int8 per row: within half a step (and bf16's rounding)
        assert ((weights - exact).abs() <= step / 2 + exact.abs() / 128 + 1e-6).all()


def test_gguf_format_needs_block_experts(tmp_path):
    files = build_gguf_fixtures()
    if files is None:
        pytest.skip("no converter")
    with pytest.raises(A3BError, match="weight_format gguf keeps a GGUF file's block-quantized experts"):
        load_model(files.moe_f32, preset="cpu", weight_format="gguf")


def test_plan_and_inspect_name_the_block_types(quantized, capsys):
    from a3b_core.__main__ import main
    assert main(["inspect", str(quantized["moe_f32"])]) == 0
    assert "Q6_K" in capsys.readouterr().out
    assert main(["plan", str(quantized["moe_f32"]), "--preset", "cpu"]) == 0
    assert "GGUF file's blocks" in capsys.readouterr().out


def test_a_type_not_read_is_refused_naming_tensor_and_type(tmp_path):
    files = build_gguf_fixtures()
    if files is None:
        pytest.skip("no converter")
    path = tmp_path / "iq.gguf"
    requantize(files.moe_f32, path, lambda name, shape: "Q3_K" if name == "blk.0.ffn_down_exps.weight" else None)
    data = bytearray(path.read_bytes())
    # retype the tensor's record as IQ3_S (Q3_K's block size and bytes): its type id follows its name, rank and shape
    name = b"blk.0.ffn_down_exps.weight"
    at = data.index(name) + len(name) + 4 + 3 * 8
    assert int.from_bytes(data[at:at + 4], "little") == gguf.GGMLQuantizationType.Q3_K
    data[at:at + 4] = int(gguf.GGMLQuantizationType.IQ3_S).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.ffn_down_exps.weight' is stored as IQ3_S"):
        GGUFCheckpoint(path)
    with pytest.raises(A3BError, match="IQ3_S"):
        load_model(path, preset="cpu", compute_dtype="float32")
    assert np.frombuffer(bytes(data[:4]), np.uint8).tobytes() == b"GGUF"


def test_decoding_computes_each_layers_experts_in_one_step(quantized, monkeypatch, one_thread):
    """A bf16 model's all-Q8_0 experts decode through the one-call routed step (QuantizedExperts.routed_step), which
    equals the experts one by one (both code their rows as int8), and the decoded sequence's logits are as near the
    same file's dequantized to fp32 as bf16 without the kernels is; an fp32 model's experts keep their exact
    products."""
    blocks = load_model(quantized["converter_q8_0"], preset="cpu", compute_dtype="bfloat16", weight_format="gguf")
    experts = blocks.text.layers[0].mlp.experts
    x = torch.randn(1, experts.gate_up_proj.shape[2]).bfloat16()
    top_i, top_p = torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])
    if not experts.takes(x, top_i, top_p):
        pytest.skip("numba is not installed or its kernels did not compile")
    assert not experts.takes(x.float(), top_i, top_p)  # fp32 rows: the exact products
    step = experts.routed_step(x, top_i, top_p).float()
    one_by_one = sum(p * experts.down(e, torch.nn.functional.silu(h[:, :h.shape[1] // 2]) * h[:, h.shape[1] // 2:])
                     for e, p, h in ((e, 0.5, experts.gate_up(e, x).float()) for e in (0, 1)))
    # one by one rounds the intermediates to bf16, the step keeps them in fp32
    torch.testing.assert_close(step, one_by_one.float(), rtol=0, atol=2e-2 * one_by_one.abs().max().item())
    prompt = blocks.tokenizer.encode(TEXT_PROMPT)
    ids = torch.tensor([prompt + blocks.generate(prompt, max_new_tokens=8, temperature=0).token_ids])
    got = blocks.logits(ids).float()
    monkeypatch.setenv("A3B_NO_NUMBA", "1")  # the same file in bf16 without kernels: dequantized, torch's products
    torch_bf16 = load_model(quantized["converter_q8_0"], preset="cpu", compute_dtype="bfloat16").logits(ids).float()
    exact = load_model(quantized["converter_q8_0"], preset="cpu", compute_dtype="float32", weight_format="fp32")
    want = exact.logits(ids).float()
    # the decoded sequence's logits: the int8 codes add no more error than bf16 itself makes (measured: 15.4% and
    # 16.7% relative RMS from the fp32 logits; the tiny random model amplifies any rounding)
    assert (got - want).norm() <= 1.25 * (torch_bf16 - want).norm()
