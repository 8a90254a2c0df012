"""The real Qwen3.5-35B-A3B's shapes on a stand-in GPU: each preset's plan holds what the engine puts on the GPU.

The published checkpoints' header inventories (tests/data) become sparse safetensors shards: real headers, the data
a hole in each file (no disk used, nothing read). They are loaded as fake tensors (tests/fake_cuda.py), and a tracker
follows the bytes of live CUDA storages. The whole model checks the weights and the cache against the plan; a cut of
it (its first four layers, three DeltaNet and one full attention, at the real widths: activations are per layer)
checks one prefill chunk at the end of each preset's context and a batch of per-image prompts against the plan's
activation workspace and cache. Prefilling the whole model on fake tensors would take minutes per preset.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from a3b_core import load_model
from a3b_core.models.qwen3_5.sizes import deltanet_state_bytes, kv_bytes
from a3b_core.release.safetensors import DTYPES
from a3b_core.runtime.placement import GiB
from tests.fake_cuda import FakeCuda
from tests.test_placement import DATA, inventory

SHARD_BYTES = 4 * GiB  # each shard is mapped on its own; no single mapping larger than a real release's shards
NOT_WEIGHTS = ("cuda_context", "workspace", "kv_cache", "deltanet_state")


def write_sparse_checkpoint(folder: Path, kind: str, layers: int | None = None) -> None:
    """config.json and shards whose headers list the real tensors (of the first `layers` text layers, or all); their
    data is never written."""
    folder.mkdir(parents=True)
    config = json.loads((DATA / "qwen3_5_35b_a3b.config.json").read_text())
    tensors = inventory(kind)
    if layers is not None:
        text = config["text_config"]
        text["num_hidden_layers"], text["layer_types"] = layers, text["layer_types"][:layers]
        tensors = {name: spec for name, spec in tensors.items()
                   if ".layers." not in name or "mtp." in name or int(name.split(".layers.")[1].split(".")[0]) < layers}
    (folder / "config.json").write_text(json.dumps(config))
    names = {dtype: name for name, dtype in DTYPES.items()}
    shards: list[dict] = [{}]
    size = 0
    for name, (shape, dtype) in tensors.items():
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [size, size + nbytes]}
        size += nbytes
    weight_map = {}
    for number, header in enumerate(shards, start=1):
        shard = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        raw = json.dumps(header).encode()
        with open(folder / shard, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + max(end for _, end in (e["data_offsets"] for e in header.values())))
        weight_map.update(dict.fromkeys(header, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def load_on_fake_gpu(folder: Path, kind: str, preset: str) -> tuple[object, FakeCuda]:
    """Experts in RAM as released (bf16 / fp8), so loading converts nothing; RAM as on a 96 GB machine."""
    fake = FakeCuda(fake_weights=True)
    with fake:
        model = load_model(folder, preset=preset, device="cuda", weight_format=kind, ram_budget=96 * GiB)
    assert model.plan.dense_device == "cuda" and model.plan.vision_device == "cuda"
    return model, fake


def planned(plan, *names: str, weights: bool = False) -> int:
    """Bytes of the plan's GPU parts with these names, or of its weights (everything but reserves and caches)."""
    reserved = ("cuda_context", "workspace", "kv_cache", "deltanet_state")
    return sum(p.bytes for p in plan.parts
               if p.device == "cuda" and (p.name in names or weights and p.name not in reserved))


@pytest.fixture(scope="module")
def whole_35b(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sparse") / "Qwen3.5-35B-A3B"
    write_sparse_checkpoint(folder, "bf16")
    return folder


@pytest.fixture(scope="module")
def cut_35b(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sparse") / "Qwen3.5-35B-A3B-FP8-4-layers"
    write_sparse_checkpoint(folder, "fp8", layers=4)
    return folder


def check_weights_and_cache(model, fake: FakeCuda) -> None:
    plan = model.plan
    assert 0.95 * planned(plan, weights=True) < fake.memory.live <= planned(plan, weights=True)
    with fake:
        cache = model.new_cache(1, plan.max_context)
    assert cache.nbytes <= planned(plan, "kv_cache", "deltanet_state")
    assert fake.memory.live <= planned(plan, "kv_cache", "deltanet_state", weights=True)


@pytest.mark.parametrize("preset", ["8gb", "12gb", "24gb"])
def test_the_weights_and_the_cache_are_what_the_plan_counts(whole_35b, preset):
    check_weights_and_cache(*load_on_fake_gpu(whole_35b, "bf16", preset))


@pytest.mark.parametrize("preset", ["8gb", "48gb"])
def test_fp8_weights_and_the_cache_are_what_the_plan_counts(cut_35b, preset):
    """The FP8 release (its experts are stored one by one, slow to load as fake tensors), cut to four layers: dense
    parts dequantized to bf16, FP8 experts on the GPU at 48gb with their block scales."""
    model, fake = load_on_fake_gpu(cut_35b, "fp8", preset)
    assert model.plan.dense_format == "bf16"
    assert (model.plan.expert_format_gpu, len(model.plan.gpu_expert_layers)) == ("fp8", 4 if preset == "48gb" else 0)
    check_weights_and_cache(model, fake)


@pytest.mark.parametrize("preset, chunks", [("8gb", 2.5), ("48gb", 1)])
def test_a_prompt_ending_at_the_full_context_prefills_within_the_workspace(cut_35b, preset, chunks):
    """The 8gb case's prompt is longer than one chunk, so it is prefilled in chunks; the 48gb case's ends at the
    longest context of all (262,144 tokens)."""
    model, fake = load_on_fake_gpu(cut_35b, "fp8", preset)
    plan = model.plan
    chunk = model.prefill_chunk(1)
    assert chunk >= 512
    length = int(chunks * chunk)
    with fake:
        cache = model.new_cache(1, plan.max_context)
        cache.length = start = plan.max_context - length
        positions = torch.arange(start, start + length).view(1, 1, -1).expand(3, 1, -1).to("cuda")
        before = fake.memory.live
        fake.memory.reset_peak()
        model.prefill(torch.zeros(1, length, dtype=torch.long), None, cache, None, positions)
    assert cache.length == plan.max_context
    assert fake.memory.peak - before <= plan.workspace_bytes


def test_a_per_image_batch_fits_the_planned_cache_and_workspace(cut_35b):
    model, fake = load_on_fake_gpu(cut_35b, "fp8", "8gb")
    plan = model.plan
    rows_that_fit = plan.cache_bytes // (kv_bytes(model.config, 300 + 2, "bf16", "bf16")
                                         + deltanet_state_bytes(model.config))
    assert 4 <= rows_that_fit < 16  # 16 prompts of 300 tokens need more than one batch
    with fake:
        before = fake.memory.live
        fake.memory.reset_peak()
        results = model.generate_batch([[7] * 300] * 16, max_new_tokens=2, temperature=0)
    assert len(results) == 16 and {r.stats["batch_size"] for r in results} <= set(range(1, rows_that_fit + 1))
    assert fake.memory.peak - before <= plan.cache_bytes + plan.workspace_bytes
