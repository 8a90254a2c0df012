"""Tiny GGUF files made from the tiny fixtures by llama.cpp's own converter (convert_hf_to_gguf.py), as a user makes
them from a release.

The converter is pure Python; it comes from the llama-cpp-python source package on PyPI (its vendored llama.cpp:
convert_hf_to_gguf.py, conversion/, gguf-py/), downloaded once with pip and cached with the converted files under
`$A3B_TEST_CACHE/gguf-<key>` (default /tmp/a3b-test-cache). `build_gguf_fixtures()` returns None when the source
package cannot be had (no network, no mirror): the tests that need it skip and say so.

Two workarounds the tiny fixtures need (see the converter trial notes): `--no-mtp` for Qwen3.5 (the fixtures have
no MTP layer, which the converter exports by default), and the BPE pre-tokenizer hash check bypassed (the tiny
vocabulary is no known model's): the wrapper answers `gpt-2`, which is what the tiny tokenizer.json's ByteLevel
pre-tokenizer is (one file says `qwen35`, the real Qwen3.5 regex, to test that path). A tokenizer_config.json is
put beside the copy so that eos and the chat template are written.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests import tiny_models as tm
from tests.tiny_qwen3_vl import build_qwen3_vl_fixtures

SDIST = "llama-cpp-python==0.3.36"
VENDOR = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
# the converter, and Qwen2's vocabulary with llama.cpp's test texts and the ids the original tokenizer gave them
NEEDED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-qwen2.gguf")
WRAPPER = '''"""convert_hf_to_gguf.py, with $TOKPRE answering the pre-tokenizer check for unknown vocabularies."""
import os, runpy, sys
from pathlib import Path
root = Path(os.environ["LLAMA_CPP_DIR"])
sys.path.insert(0, str(root)); sys.path.insert(1, str(root / "gguf-py"))
from conversion.base import TextModel
_orig = TextModel.get_vocab_base_pre
def _pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        return os.environ["TOKPRE"]
TextModel.get_vocab_base_pre = _pre
sys.argv = [str(root / "convert_hf_to_gguf.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''
TOKENIZER_CONFIG = {
    "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False,
    "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
}


@dataclass(frozen=True)
class GgufFixtures:
    root: Path
    moe_f32: Path  # from tiny_models' moe_hf (Qwen3.5-MoE, per-expert safetensors)
    moe_fused_exps_f32: Path  # the same, converted with --fuse-gate-up-exps (ffn_gate_up_exps)
    moe_bf16: Path
    moe_q8_0: Path  # every matrix Q8_0, as the converter's --outtype q8_0 writes it
    dense_f32: Path  # from tiny_models' dense (Qwen3.5 dense)
    vl_moe_f32: Path  # from tiny_qwen3_vl's moe_bf16 (Qwen3-VL-MoE in the official transposed layout)
    vl_dense_f32: Path
    dense_qwen35_pre: Path  # dense_f32 with tokenizer.ggml.pre = qwen35 (the real Qwen3.5 pre-tokenizer regex)
    moe_mtp_f32: Path  # moe_hf plus an MTP layer (as the real releases have), converted with it (blk.4.*, nextn)
    moe_mmproj_f32: Path  # the vision projector (--mmproj) of moe_hf: a Qwen3.5 vision tower
    vl_moe_mmproj_f32: Path  # the vision projector of vl/moe_bf16: a Qwen3-VL vision tower with DeepStack


# name -> (source fixture, converter arguments, tokenizer.ggml.pre written for the tiny vocabulary)
CONVERSIONS = {
    "moe_f32": ("moe_hf", ["--no-mtp", "--outtype", "f32"], "gpt-2"),
    "moe_fused_exps_f32": ("moe_hf", ["--no-mtp", "--outtype", "f32", "--fuse-gate-up-exps"], "gpt-2"),
    "moe_bf16": ("moe_hf", ["--no-mtp", "--outtype", "bf16"], "gpt-2"),
    "moe_q8_0": ("moe_hf", ["--no-mtp", "--outtype", "q8_0"], "gpt-2"),
    "dense_f32": ("dense", ["--no-mtp", "--outtype", "f32"], "gpt-2"),
    "vl_moe_f32": ("vl/moe_bf16", ["--outtype", "f32"], "gpt-2"),
    "vl_dense_f32": ("vl/dense", ["--outtype", "f32"], "gpt-2"),
    "dense_qwen35_pre": ("dense", ["--no-mtp", "--outtype", "f32"], "qwen35"),
    "moe_mtp_f32": ("moe_mtp", ["--outtype", "f32"], "gpt-2"),
    "moe_mmproj_f32": ("moe_hf", ["--mmproj", "--outtype", "f32"], "gpt-2"),
    "vl_moe_mmproj_f32": ("vl/moe_bf16", ["--mmproj", "--outtype", "f32"], "gpt-2"),
}


def cache_key() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(tm.cache_key().encode())
    return digest.hexdigest()[:16]


def build_gguf_fixtures() -> GgufFixtures | None:
    """The converted files (built once); None when llama.cpp's converter cannot be downloaded."""
    cache = Path(os.environ.get("A3B_TEST_CACHE", "/tmp/a3b-test-cache"))
    converter = converter_dir(cache / "llama-cpp-python-0.3.36")
    if converter is None:
        return None
    qwen35, vl = tm.build_fixtures(), build_qwen3_vl_fixtures()
    sources = {"moe_hf": qwen35.moe_hf, "dense": qwen35.dense, "vl/moe_bf16": vl.moe_bf16, "vl/dense": vl.dense}
    root = cache / f"gguf-{cache_key()}"
    tm.build_once(root, lambda staging: _convert_all(staging, converter, sources))
    return GgufFixtures(root=root, **{name: root / f"{name}.gguf" for name in CONVERSIONS})


def qwen2_vocabulary() -> Path | None:
    """llama.cpp's models/ggml-vocab-qwen2.gguf (beside it its .inp test texts and .out ids); None if the source
    package cannot be downloaded."""
    cache = Path(os.environ.get("A3B_TEST_CACHE", "/tmp/a3b-test-cache"))
    converter = converter_dir(cache / "llama-cpp-python-0.3.36")
    return None if converter is None else converter / "models" / "ggml-vocab-qwen2.gguf"


def converter_dir(where: Path) -> Path | None:
    """llama.cpp's converter unpacked under `where` (downloaded the first time); None if pip cannot get it."""
    root = where / "llama.cpp"
    if all((root / part).exists() for part in NEEDED):
        return root
    where.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where.parent) as tmp:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            SDIST, "-d", tmp], check=True, capture_output=True, timeout=600)
            (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        except (subprocess.SubprocessError, OSError, ValueError):
            return None
        staging = Path(tmp) / "llama.cpp"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and ".." not in Path(m.name).parts
                       and any(m.name.startswith(VENDOR + part) for part in NEEDED)]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.10.12+ / 3.11.4+
            for member in members:
                member.name = member.name[len(VENDOR):]
                tar.extract(member, staging, **safe)
        (staging / "a3b_wrapper.py").write_text(WRAPPER)
        where.mkdir(exist_ok=True)
        if root.exists():  # an older unpacking, without every needed part
            shutil.rmtree(root)
        staging.rename(root)
    return root


def _convert_all(out: Path, converter: Path, sources: dict[str, Path]) -> None:
    models = out / "models"
    for name, source in sources.items():
        copy = models / name
        shutil.copytree(source, copy)
        (copy / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    _add_mtp_layer(models / "moe_hf", models / "moe_mtp")
    env = {**os.environ, "LLAMA_CPP_DIR": str(converter), "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    for name, (source, args, pre) in CONVERSIONS.items():
        command = [sys.executable, str(converter / "a3b_wrapper.py"), str(models / source), *args,
                   "--outfile", str(out / f"{name}.gguf")]
        result = subprocess.run(command, env={**env, "TOKPRE": pre}, capture_output=True, text=True, timeout=600)
        if result.returncode:
            raise RuntimeError(f"converting {source} ({' '.join(args)}) failed:\n{result.stderr[-3000:]}")
    shutil.rmtree(models)


def _add_mtp_layer(source: Path, out: Path) -> None:
    """A copy of a Qwen3.5-MoE fixture with an MTP block as the releases have it (mtp.fc, three norms and one
    full-attention MoE layer, here a copy of the last decoder layer) and mtp_num_hidden_layers = 1."""
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    last, hidden = text["num_hidden_layers"] - 1, text["hidden_size"]
    layer = f"model.language_model.layers.{last}."
    generator = torch.Generator().manual_seed(5)
    tensors |= {"mtp.layers.0." + name[len(layer):]: value.clone() for name, value in tensors.items()
                if name.startswith(layer)}
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.02
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=generator) * 0.1
    save_file(tensors, out / "model.safetensors")
    text["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
