"""GGUF files (F32 / F16 / BF16) as llama.cpp's own converter writes them from the tiny fixtures: every tensor of the
release equals the GGUF checkpoint's, the config and tokenizer from the metadata equal the release's, load_model on
the .gguf gives the folder's logits, and bad files are refused by name."""
import dataclasses
import json
import re
import struct

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from a3b_core import load_model
from a3b_core.errors import CheckpointError
from a3b_core.models import load_config, parse_config
from a3b_core.prompting.gguf_tokenizer import QWEN35, tokenizer_from_gguf
from a3b_core.prompting.tokenizer import Tokenizer
from a3b_core.release.gguf import GGUFCheckpoint
from a3b_core.release.gguf_config import config_from_gguf
from a3b_core.release.safetensors import Checkpoint
from tests.tiny_gguf import qwen2_vocabulary
from tests.tiny_models import TEXT_PROMPT, build_fixtures
from tests.tiny_qwen3_vl import build_qwen3_vl_fixtures

gguf = pytest.importorskip("gguf", reason="the gguf package (requirements.txt) is not installed")

TEXT = "model.language_model."
STRINGS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "  leading  and   multiple   spaces  ",
    "tabs\tand\nnewlines\r\n\n", "\n\n\n", "", "x" * 50, "I'm you're they'll we'd IT'S",
    "<|im_start|>user\nDescribe <|vision_start|><|image_pad|><|vision_end|> please<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer", "def f(x):\n    return x**2 + 3.14159  # comment\n",
    "数字 12345 and 3.0e-7", "日本語のテキスト、中文文本。한국어", "émojis 😀👍🏽 🇫🇷 and ünïcödé", "a\u0301 combining",
    "https://example.com/a?b=c&d=e", "Ελληνικά кириллица العربية हिन्दी",
]


def sources():
    qwen35, vl = build_fixtures(), build_qwen3_vl_fixtures()
    return {"moe_f32": qwen35.moe_hf, "moe_fused_exps_f32": qwen35.moe_hf, "moe_bf16": qwen35.moe_hf,
            "moe_mtp_f32": qwen35.moe_hf,  # its MTP layer is not exposed: the trunk equals moe_hf
            "dense_f32": qwen35.dense, "vl_moe_f32": vl.moe_bf16, "vl_dense_f32": vl.dense}


def release_tensor(ckpt: GGUFCheckpoint, name: str, want: torch.Tensor) -> torch.Tensor:
    """The GGUF checkpoint's tensor for a release tensor `name` (per-expert release names are matrices of the fused
    experts; Qwen3-VL's transposed expert release is compared transposed)."""
    per_expert = re.match(r"(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$", name)
    if per_expert:
        base, j, kind = per_expert[1], int(per_expert[2]), per_expert[3]
        if kind == "down":
            return ckpt.weight_at(base + "down_proj", j)
        gate_up = ckpt.weight_at(base + "gate_up_proj", j)
        half = gate_up.shape[0] // 2
        return gate_up[:half] if kind == "gate" else gate_up[half:]
    got = ckpt.weight(name)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and got.shape != want.shape:
        return got.transpose(1, 2)
    return got


@pytest.mark.parametrize("name", ["moe_f32", "moe_fused_exps_f32", "moe_bf16", "moe_mtp_f32", "dense_f32",
                                  "vl_moe_f32", "vl_dense_f32"])
def test_every_tensor_of_the_release_equals_the_gguf_checkpoints(ggufs, name, one_thread):
    release = Checkpoint(sources()[name])
    ckpt = GGUFCheckpoint(getattr(ggufs, name))
    used = set()
    for hf_name in release.infos:
        if ".visual." in hf_name:
            continue  # the vision tower goes to the mmproj file
        want = release.weight(hf_name)
        got = release_tensor(ckpt, hf_name, want)
        used.add(re.sub(r"experts\.\d+\.(gate|up)_proj\.weight$", "experts.gate_up_proj",
                        re.sub(r"experts\.\d+\.down_proj\.weight$", "experts.down_proj", hf_name)))
        assert got.shape == want.shape, hf_name
        if hf_name.endswith("A_log"):  # stored as -exp(A_log): log(-x) is exact to rounding
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(got, want), hf_name  # exact: f32, and the fixtures' weights are bf16 values
    assert used == set(ckpt.infos)  # nothing left over on either side


def test_the_mtp_layer_is_in_the_file_but_not_in_the_checkpoint(ggufs):
    reader = gguf.GGUFReader(ggufs.moe_mtp_f32)
    assert reader.fields["qwen35moe.block_count"].contents() == 5
    assert any(t.name.startswith("blk.4.nextn.") for t in reader.tensors)
    assert set(GGUFCheckpoint(ggufs.moe_mtp_f32).infos) == set(GGUFCheckpoint(ggufs.moe_f32).infos)


def test_infos_have_the_release_layouts(ggufs):
    ckpt = GGUFCheckpoint(ggufs.moe_f32)
    layer = f"{TEXT}layers.0."
    assert ckpt.infos[layer + "mlp.experts.gate_up_proj"].shape == (8, 512, 128)
    assert ckpt.infos[layer + "mlp.experts.down_proj"].shape == (8, 128, 256)
    assert ckpt.infos[layer + "linear_attn.conv1d.weight"].shape == (256, 1, 4)
    assert ckpt.infos[layer + "mlp.shared_expert_gate.weight"].shape == (1, 128)
    assert ckpt.raw(TEXT + "embed_tokens.weight").untyped_storage().data_ptr() != 0  # a view of the mapped file
    assert GGUFCheckpoint(ggufs.moe_bf16).infos[TEXT + "embed_tokens.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["moe_f32", "moe_mtp_f32", "dense_f32", "vl_moe_f32", "vl_dense_f32"])
def test_config_from_the_metadata_equals_the_releases(ggufs, name):
    path = getattr(ggufs, name)
    got = parse_config(config_from_gguf(gguf.GGUFReader(path), str(path)), str(path))
    want = load_config(sources()[name])
    assert got.model_type == want.model_type and got.vision is None
    assert dataclasses.asdict(got.text) == dataclasses.asdict(want.text)
    assert [got.image_token_id, got.video_token_id, got.vision_start_token_id, got.vision_end_token_id] == \
        [want.image_token_id, want.video_token_id, want.vision_start_token_id, want.vision_end_token_id]


def test_tokenizer_from_the_metadata_gives_the_releases_ids(ggufs):
    ours = tokenizer_from_gguf(gguf.GGUFReader(ggufs.moe_f32), str(ggufs.moe_f32))
    theirs = Tokenizer.from_folder(build_fixtures().moe_hf)
    for text in STRINGS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids)
    assert ours.control_tokens == theirs.control_tokens and ours.vocab_size == theirs.vocab_size


def test_qwen35_pre_tokenizer_matches_a_tokenizer_json_with_it(ggufs):
    """The file says tokenizer.ggml.pre = qwen35: the same ids as the release's tokenizer.json would give with
    Qwen3.5's own normalizer and pre-tokenizer (as the real release's tokenizer.json spells them)."""
    spec = json.loads((build_fixtures().moe_hf / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN35}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    theirs = HFTokenizer.from_str(json.dumps(spec))
    ours = tokenizer_from_gguf(gguf.GGUFReader(ggufs.dense_qwen35_pre), "qwen35")
    differs_from_gpt2 = False
    for text in STRINGS:
        ids = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == ids, text
        differs_from_gpt2 |= HFTokenizer.from_str(
            (build_fixtures().moe_hf / "tokenizer.json").read_text()).encode(text, add_special_tokens=False).ids != ids
    assert differs_from_gpt2  # the strings tell the two regexes apart


@pytest.mark.parametrize("name", ["moe_f32", "moe_mtp_f32", "dense_f32", "vl_moe_f32", "vl_dense_f32"])
def test_load_model_on_a_gguf_gives_the_folders_logits(ggufs, name, one_thread):
    ours = load_model(getattr(ggufs, name), preset="cpu", compute_dtype="float32")
    theirs = load_model(sources()[name], preset="cpu", compute_dtype="float32")
    ids = torch.tensor([theirs.tokenizer.encode(TEXT_PROMPT)])
    assert ours.tokenizer.encode(TEXT_PROMPT) == ids[0].tolist()
    torch.testing.assert_close(ours.logits(ids), theirs.logits(ids), rtol=0, atol=1e-5)
    assert ours.config.text.eos_token_ids == theirs.config.text.eos_token_ids
    assert ours.chat_template_in_use == "model folder: GGUF tokenizer.chat_template"


def test_plan_and_inspect_read_a_gguf(ggufs, capsys):
    from a3b_core.__main__ import main
    assert main(["inspect", str(ggufs.moe_mtp_f32)]) == 0
    out = capsys.readouterr().out
    assert "qwen3_5_moe, 4 layers" in out and "expert layout: fused [E, 2I, H]" in out and "72 in 1 files" in out
    assert main(["plan", str(ggufs.vl_moe_f32), "--preset", "cpu"]) == 0
    assert "routed_experts_cpu" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ bad files
def gguf_bytes(arch: str = "qwen3vl", tensors=(("token_embd.weight", (8, 2), 0, 0),), version: int = 3,
               data_bytes: int | None = None) -> bytes:
    """A GGUF file by hand: general.architecture and tensor records (name, ne, type id, data offset)."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), 1)
    head += string("general.architecture") + struct.pack("<I", 8) + string(arch)
    for name, ne, type_id, offset in tensors:
        head += string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        head += struct.pack("<IQ", type_id, offset)
    head += b"\0" * (-len(head) % 32)
    return head + b"\0" * (64 if data_bytes is None else data_bytes)


@pytest.mark.parametrize("blob, message", [
    (b"PK\x03\x04" + b"\0" * 60, "not a GGUF file"),
    (b"GGUF\x03\0", "too short to be GGUF"),
    (gguf_bytes(version=7), "GGUF version 7 is not supported"),
    (gguf_bytes()[:40], "header ends inside"),
    (gguf_bytes(data_bytes=16), r"needs bytes \[\d+, \d+\) but the file has"),
    (gguf_bytes(tensors=(("token_embd.weight", (8, 2), 0, 1 << 20),)), r"needs bytes .* but the file has"),
    (gguf_bytes(tensors=(("token_embd.weight", (8, 2), 0, 0), ("output.weight", (8, 2), 0, 32)), data_bytes=96),
     "overlap"),
    (gguf_bytes(tensors=(("token_embd.weight", (8, 2), 99, 0),)), "type id 99"),
    (gguf_bytes(tensors=(("token_embd.weight", (8, 2), 0, 8),)), "not a multiple of the alignment"),
    (gguf_bytes(arch="llama"), "architecture 'llama' is not supported"),
    (gguf_bytes(tensors=(("blk.0.attn_norm.weight", (8,), 0, 0), ("blk.0.mystery.weight", (8,), 0, 32))),
     "'blk.0.mystery.weight' is not one llama.cpp's converter writes"),
])
def test_bad_files_are_refused_by_name(tmp_path, blob, message):
    path = tmp_path / "model.gguf"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=message) as refused:
        GGUFCheckpoint(path)
    assert str(path) in str(refused.value)


def test_a_truncated_real_file_is_refused_before_loading(ggufs, tmp_path):
    data = ggufs.moe_f32.read_bytes()
    for cut in (len(data) // 2, 5000):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated or corrupt"):
            load_model(path, preset="cpu", compute_dtype="float32")


def test_qwen2_vocabulary_gives_the_original_tokenizers_ids():
    """Qwen2's whole tokenizer as llama.cpp ships it (models/ggml-vocab-qwen2.gguf, 151,643 BPE tokens) gives, on
    llama.cpp's tokenizer test texts (scripts, accents, code, emoji, whitespace runs, digits), the ids the original
    Hugging Face tokenizer gave them (the .out file beside it)."""
    vocabulary = qwen2_vocabulary()
    if vocabulary is None:
        pytest.skip("llama.cpp's source package could not be downloaded")
    ours = tokenizer_from_gguf(gguf.GGUFReader(vocabulary), str(vocabulary))
    texts = vocabulary.with_name(vocabulary.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = vocabulary.with_name(vocabulary.name + ".out").read_text(encoding="utf-8").split("\n")
    assert len(texts) == len(ids) > 40
    for text, line in zip(texts[:-1], ids[:-1]):  # both files end with a separator
        assert ours.encode(text) == [int(i) for i in line.split()], repr(text)
