"""Checkpoint reading: headers, shards, FP8 dequantization, and every way a folder can be broken."""
import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from a3b_core.errors import CheckpointError
from a3b_core.release.safetensors import Checkpoint, dequantize_fp8, read_header


def write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_single_file_tensors_are_memory_mapped_views(tmp_path):
    a = torch.arange(12, dtype=torch.float32).view(3, 4)
    save_file({"a": a, "b": torch.ones(5, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    ckpt = Checkpoint(tmp_path)
    assert ckpt.infos["a"].shape == (3, 4) and ckpt.infos["b"].dtype == torch.bfloat16
    assert torch.equal(ckpt.raw("a"), a)
    assert ckpt.weight("b").dtype == torch.float32


def test_sharded_index_with_official_shard_names(tmp_path):
    names = ["model.safetensors-00001-of-00002.safetensors", "model.safetensors-00002-of-00002.safetensors"]
    save_file({"x": torch.zeros(2)}, tmp_path / names[0])
    save_file({"y": torch.ones(3)}, tmp_path / names[1])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": names[0], "y": names[1]}}))
    ckpt = Checkpoint(tmp_path)
    assert set(ckpt.infos) == {"x", "y"} and ckpt.infos["y"].file.name == names[1]


def test_missing_shard_is_named(tmp_path):
    save_file({"x": torch.zeros(2)}, tmp_path / "a.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "a.safetensors", "y": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        Checkpoint(tmp_path)


def test_truncated_file(tmp_path):
    save_file({"x": torch.zeros(1000)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("header,data,message", [
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "truncated"),
    ({"x": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, "dtype 'Q4'"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 16]}}, b"\0" * 16, "malformed"),
    ({"x": {"dtype": "F32", "shape": [2**39, 2**39], "data_offsets": [0, 16]}}, b"\0" * 16, "needs"),
    ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
      "y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24, "overlap"),
    ({"x": [1, 2]}, b"", "malformed"),
])
def test_hostile_headers(tmp_path, header, data, message):
    write_raw(tmp_path / "model.safetensors", header, data)
    with pytest.raises(CheckpointError, match=message):
        read_header(tmp_path / "model.safetensors")


def test_header_length_beyond_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="header claims"):
        Checkpoint(tmp_path)


def test_header_not_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint(tmp_path)


def test_5000_digit_integers_in_header_and_index(tmp_path):
    blob = b'{"__metadata__": {}, "x": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}'
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 4)
    with pytest.raises(CheckpointError, match="model.safetensors: header is not valid JSON .*digits"):
        read_header(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"x": "a.safetensors"}, "n": ' + "9" * 5000
                                                          + "}")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: cannot be read .*digits"):
        Checkpoint(tmp_path)


def test_pickle_only_folder_is_refused_without_loading(tmp_path):
    # a real pickle that would run code if unpickled: the loader must never open it
    (tmp_path / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch pwned'\ntR.")
    with pytest.raises(CheckpointError, match="pickle.*never loaded"):
        Checkpoint(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match="no .safetensors"):
        Checkpoint(tmp_path)


def test_symlink_outside_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file({"x": torch.zeros(2)}, outside / "w.safetensors")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(outside / "w.safetensors")
    with pytest.raises(CheckpointError, match="outside the model folder"):
        Checkpoint(model)


def fp8_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.empty(grid)
    for r in range(grid[0]):
        for c in range(grid[1]):
            tile = w[r * block:(r + 1) * block, c * block:(c + 1) * block]
            scale[r, c] = tile.abs().max() / 448
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_dequant_uses_ceil_div_blocks(tmp_path, scale_dtype):
    # 200 x 300 is not a multiple of 128: edge blocks are partial (transformers' rows // scale_rows gets this wrong)
    w = torch.randn(200, 300)
    q, scale = fp8_quantize(w)
    save_file({"m.weight": q, "m.weight_scale_inv": scale.to(scale_dtype)}, tmp_path / "model.safetensors")
    got = Checkpoint(tmp_path).weight("m.weight")
    expected = q.float() * scale.to(scale_dtype).float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert torch.equal(got, expected)
    assert (got - w).abs().max() < 0.07 * w.abs().max()


def test_fp8_per_tensor_scale(tmp_path):
    q = torch.randn(8, 8).to(torch.float8_e4m3fn)
    save_file({"m.weight": q, "m.weight_scale": torch.tensor(0.5)}, tmp_path / "model.safetensors")
    assert torch.equal(Checkpoint(tmp_path).weight("m.weight"), q.float() * 0.5)


def test_fp8_without_scale_is_named(tmp_path):
    save_file({"m.weight": torch.randn(8, 8).to(torch.float8_e4m3fn)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'m.weight' is stored as FP8 but has no"):
        Checkpoint(tmp_path).weight("m.weight")


def test_fp8_scale_grid_mismatch():
    with pytest.raises(CheckpointError, match="does not fit"):
        dequantize_fp8(torch.zeros(256, 256).to(torch.float8_e4m3fn), torch.ones(3, 2))


def test_missing_tensor_is_named(tmp_path):
    save_file({"x": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'y' is missing"):
        Checkpoint(tmp_path).raw("y")
