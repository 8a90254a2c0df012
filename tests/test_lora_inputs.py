"""LoRA adapters beside every weight format, on the stand-in GPU, and every bad adapter refused by name with the model
left as it was. (Agreement with PEFT itself: tests/test_lora.py.)"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from a3b_core import load_model
from a3b_core.errors import AdapterError
from a3b_core.formats.kernel_stores import kernels_enabled
from a3b_core.formats.lora import AdaptedExperts
from a3b_core.runtime.adapters import KEPT_ADAPTERS
from a3b_core.runtime.loader import DEMO_MODELS
from tests.fake_cuda import FakeCuda
from tests.synthetic_adapters import factors, qwen3_5_adapter, write_adapter

pytestmark = pytest.mark.usefixtures("one_thread")

HEART = Path(__file__).parent.parent / "workflows" / "inputs" / "a3b_pixel_art" / "a3b_pixel_heart.png"
Q_PROJ = "model.language_model.layers.3.self_attn.q_proj"  # the tiny models' full-attention layer: [512, 128]


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def adapter(fixtures, tmp_path_factory) -> Path:
    return qwen3_5_adapter(tmp_path_factory.mktemp("lora") / "all", config_of(fixtures.moe_fused_bf16))


@pytest.fixture(scope="module")
def fp32_model(fixtures):
    return load_model(fixtures.moe_hf, preset="cpu", compute_dtype="float32")


def state(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in [*model.text.state_dict(keep_vars=True).items()]
            if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("weight_format,dense_format", [("bf16", "auto"), ("int8", "int8"), ("int4", "int4"),
                                                        ("fp8", "auto")])
def test_the_side_path_adds_exactly_its_product_beside_every_base_format(fixtures, adapter, weight_format,
                                                                         dense_format):
    """Each adapted module's output gains x (s B A)^T in the compute dtype and nothing else: the base product is
    the same before, during and after (never dequantized into a new weight or quantized again)."""
    folder = fixtures.moe_fp8 if weight_format == "fp8" else fixtures.moe_fused_bf16
    model = load_model(folder, preset="cpu", compute_dtype="bfloat16", weight_format=weight_format,
                       dense_format=dense_format)
    before = state(model)
    layer = model.text.layers[3]
    x = torch.randn(3, 1, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    o_proj, experts = layer.self_attn.o_proj, layer.mlp.experts
    head_in = torch.randn(3, 1, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    base_o, base_e = o_proj(head_in), experts.gate_up(1, x[:, 0])
    model.set_loras([(adapter, 0.5)])
    assert isinstance(layer.mlp.experts, AdaptedExperts) and layer.step_kernel is None
    a, b = factors(128, 256, 4, 31, 0.5)  # layer 3's o_proj factors in qwen3_5_adapter
    scale = 0.5 * 2  # strength x lora_alpha / r
    want = head_in.float() @ (scale * b @ a).t()
    torch.testing.assert_close((o_proj(head_in) - base_o).float(), want, atol=0.05 * want.abs().max().item(),
                               rtol=0.05)
    a, b = factors(512, 128, 4 * 8, 33, 0.5)  # layer 3's gate_up stack: A [E r, in], B [out, r E]
    a_e, b_e = a.view(8, 4, 128)[1], b.view(512, 4, 8)[:, :, 1]
    want = x[:, 0].float() @ (scale * b_e @ a_e).t()
    got = layer.mlp.experts.gate_up(1, x[:, 0]).float() - base_e.float()
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.05)
    model.set_loras([])
    assert torch.equal(o_proj(head_in), base_o) and torch.equal(layer.mlp.experts.gate_up(1, x[:, 0]), base_e)
    after = state(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("folder,experts", [("moe_fused_bf16", True), ("moe_fused_bf16", False), ("dense", False)])
def test_decoding_with_adapters_gives_the_tokens_a_full_forward_picks(fixtures, tmp_path, folder, experts):
    """Greedy decoding (step by step: the fused decoding steps built again with the side paths, or the separate
    kernels where the routed experts are adapted) picks the tokens the full forward pass of the same model with the
    same adapters picks, wherever that pick is clear of bf16's rounding (a top-2 gap above 0.3), and the adapter
    changes the answer."""
    path = getattr(fixtures, folder)
    config = config_of(path)
    if folder == "dense":
        text = config["text_config"]
        weights = {f"model.language_model.layers.{i}.mlp.down_proj": factors(128, text["intermediate_size"], 4, i)
                   for i in range(4)}
        weights[Q_PROJ] = factors(512, 128, 4, 9)
        lora = write_adapter(tmp_path / "dense", weights, 4, 8)
    else:
        lora = qwen3_5_adapter(tmp_path / "moe", config, size=1.0, experts=experts)
    model = load_model(path, preset="cpu", compute_dtype="bfloat16")
    prompt = torch.tensor([5, 17, 99, 3, 250, 41, 7, 8])
    base = model.generate(prompt, max_new_tokens=16, temperature=0).token_ids
    steps = [layer.step_kernel for layer in model.text.layers]
    model.set_loras([(lora, 1.0)])
    if folder == "moe_fused_bf16" and kernels_enabled():  # the fused steps, built again with the side paths
        assert all((layer.step_kernel is None) == experts for layer in model.text.layers)
        assert all(new is not old for new, old in zip((layer.step_kernel for layer in model.text.layers), steps))
    tokens = model.generate(prompt, max_new_tokens=16, temperature=0).token_ids
    full = model.logits(torch.cat([prompt, torch.tensor(tokens)])[None])[0, len(prompt) - 1:-1]
    top = full.topk(2, dim=-1)
    clear = (top.values[:, 0] - top.values[:, 1] > 0.3).tolist()
    assert sum(clear) >= 3
    assert [t for t, c in zip(top.indices[:, 0].tolist(), clear) if c] == [t for t, c in zip(tokens, clear) if c]
    assert tokens != base
    model.set_loras([])
    assert [layer.step_kernel for layer in model.text.layers] == steps
    assert model.generate(prompt, max_new_tokens=16, temperature=0).token_ids == base


def test_adapters_on_a_stand_in_gpu_compute_where_their_modules_are(tmp_path):
    """The demo on the stand-in GPU (dense parts and vision tower on it, int8 experts in RAM) with an adapter on
    every kind of weight: prompts with images generate without a CPU tensor meeting a CUDA one."""
    demo = DEMO_MODELS["a3b-demo"]
    lora = qwen3_5_adapter(tmp_path / "demo", config_of(demo))
    with FakeCuda():
        model = load_model(demo, preset="8gb", device="cuda", loras=[(lora, 0.8)])
        images = model.encode_images([HEART], size=128)
        prompt = model.build_prompt("Describe [[IMG]]", images=images, thinking=False)
        model.generate(prompt, max_new_tokens=3, temperature=0)
        model.generate_batch([prompt, prompt], max_new_tokens=2, temperature=0.7, seed=1)
        model.set_loras([])
        model.generate(prompt, max_new_tokens=2, temperature=0)


def test_a_failed_change_keeps_the_adapters_on(fixtures, fp32_model, adapter, tmp_path):
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    fp32_model.set_loras([(adapter, 1.0)])
    with_adapter = fp32_model.logits(ids)
    broken = write_adapter(tmp_path / "wrong", {"model.language_model.layers.3.self_attn.q_proj":
                                                factors(512, 64, 4, 0)}, 4, 8)
    with pytest.raises(AdapterError):
        fp32_model.set_loras([(adapter, 1.0), (broken, 1.0)])
    assert fp32_model.loras == [((adapter / "adapter_model.safetensors").resolve(), 1.0)]
    assert torch.equal(fp32_model.logits(ids), with_adapter)
    fp32_model.set_loras([])


def bad_adapters(root: Path, good: Path) -> list[tuple[str, Path | str, float, str]]:
    """(case, adapter, strength, words the error must say)."""
    cases = []

    def copy(name: str) -> Path:
        folder = root / name
        shutil.copytree(good, folder)
        return folder

    pickle = root / "pickle"
    pickle.mkdir()
    (pickle / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    (pickle / "adapter_config.json").write_text("{}")
    cases.append(("pickle folder", pickle, 1.0, "pickle"))
    cases.append(("pickle file", pickle / "adapter_model.bin", 1.0, "pickle"))
    cases.append(("missing", root / "nowhere", 1.0, "not found"))
    no_config = copy("no_config")
    (no_config / "adapter_config.json").unlink()
    cases.append(("no config", no_config, 1.0, "adapter_config.json"))
    bad_json = copy("bad_json")
    (bad_json / "adapter_config.json").write_text("{r: 4")
    cases.append(("bad json", bad_json, 1.0, "JSON"))
    for name, change, words in (("loha", {"peft_type": "LOHA"}, "LOHA"), ("dora", {"use_dora": True}, "DoRA"),
                                ("no r", {"r": None}, "r (a positive integer)"), ("r mismatch", {"r": 8}, "r = 8"),
                                ("bad pattern", {"rank_pattern": {"q_proj(": 4}}, "regular expression")):
        folder = copy(name.replace(" ", "_"))
        config = json.loads((folder / "adapter_config.json").read_text()) | change
        (folder / "adapter_config.json").write_text(json.dumps(config))
        cases.append((name, folder, 1.0, words))
    a, b = factors(512, 128, 4, 0)
    cases.append(("nan", write_adapter(root / "nan", {Q_PROJ: (a, b * math.nan)}, 4, 8), 1.0, "not finite"))
    cases.append(("unpaired", write_adapter(root / "unpaired", {}, 4, 8, tensors={f"{Q_PROJ}.lora_A.weight": a}),
                  1.0, "pair"))
    cases.append(("no such module", write_adapter(root / "far", {"model.language_model.layers.9.self_attn.q_proj":
                                                                 (a, b)}, 4, 8), 1.0, "layers.9.self_attn.q_proj"))
    cases.append(("other family", write_adapter(root / "vl", {"model.language_model.layers.0.self_attn.q_proj": (a, b)},
                                                4, 8, auto_mapping={"base_model_class": "Qwen3VLMoeForConditionalGeneration"}),
                  1.0, "Qwen3VLMoeForConditionalGeneration"))
    cases.append(("wrong shape", write_adapter(root / "shape", {Q_PROJ: factors(256, 128, 4, 0)}, 4, 8), 1.0,
                  "[512, 128]"))
    cases.append(("other module replaced", write_adapter(root / "save", {Q_PROJ: (a, b)}, 4, 8, tensors={
        "model.language_model.layers.3.self_attn.o_proj.weight": torch.zeros(128, 256)}), 1.0, "modules_to_save"))
    cases.append(("resized vocab", write_adapter(root / "vocab", {Q_PROJ: (a, b)}, 4, 8, tensors={
        "lm_head.weight": torch.zeros(600, 128)}), 1.0, "[600, 128]"))
    raw = root / "raw"
    raw.mkdir()
    save_file({"something.bias": torch.zeros(2)}, raw / "adapter_model.safetensors")
    (raw / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    cases.append(("not an adapter", raw, 1.0, "neither a LoRA factor"))
    cases.append(("nan strength", good, math.nan, "strength"))
    return cases


def test_bad_adapters_are_refused_by_name_and_change_nothing(fp32_model, adapter, tmp_path):
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    base = fp32_model.logits(ids)
    failures = []
    for case, path, strength, words in bad_adapters(tmp_path, adapter):
        try:
            fp32_model.set_loras([(path, strength)])
            failures.append(f"{case}: accepted")
        except AdapterError as exc:
            if words not in str(exc) or (str(path) not in str(exc) and case != "nan strength"):
                failures.append(f"{case}: {exc}")
        assert fp32_model.loras == []
    assert not failures, "\n".join(failures)
    assert torch.equal(fp32_model.logits(ids), base)


def test_a_weights_file_given_by_itself_reads_its_config_beside_it(fp32_model, adapter):
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    fp32_model.set_loras([(adapter, 1.0)])
    by_folder = fp32_model.logits(ids)
    fp32_model.set_loras([(adapter / "adapter_model.safetensors", 1.0)])
    assert torch.equal(fp32_model.logits(ids), by_folder)
    fp32_model.set_loras([(adapter, 0.0)])  # strength 0: the base
    zero = fp32_model.logits(ids)
    fp32_model.set_loras([])
    assert torch.equal(zero, fp32_model.logits(ids))


def test_a_batch_with_adapters_decodes_each_prompt_as_alone(fixtures, tmp_path):
    """Batched generation (per-image mode, the server's batches) with adapters on, through the fused steps built
    with their side paths: each row's tokens are those of its prompt generated alone."""
    lora = qwen3_5_adapter(tmp_path / "moe", config_of(fixtures.moe_fused_bf16), size=1.0, experts=False)
    model = load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="bfloat16", loras=[(lora, 0.7)])
    prompts = [torch.tensor([5, 17, 99, 3]), torch.tensor([250, 41, 7, 8]), torch.tensor([12, 13, 14, 15])]
    alone = [model.generate(p, max_new_tokens=8, temperature=0).token_ids for p in prompts]
    batched = [r.token_ids for r in model.generate_batch(prompts, max_new_tokens=8, temperature=0)]
    assert batched == alone


def test_only_the_adapters_used_last_stay_read(fp32_model, tmp_path):
    folders = [write_adapter(tmp_path / f"a{i}", {Q_PROJ: factors(512, 128, 2, i)}, 2, 2)
               for i in range(KEPT_ADAPTERS + 2)]
    for folder in folders:
        fp32_model.set_loras([(folder, 1.0)])
    fp32_model.set_loras([])
    kept = {key[0].parent.name for key in fp32_model.adapters.read}
    assert kept == {f"a{i}" for i in range(2, KEPT_ADAPTERS + 2)}
