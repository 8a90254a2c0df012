"""Fuzzing the parsers that read what users hand us (safetensors headers, config.json, tokenizer.json, prompt text,
image files), the chat template sandbox, and the caption file paths Save Captions builds from node inputs, and a short
soak: many generations in one process leave no cache behind.

Each property is "a specific A3BError, or a valid result" - never another exception, a crash or a huge allocation
(and for caption files: never a file outside the output folder). Examples are derandomized (the same every run, so
CI is reproducible) and the local database is off. Budget: about 50 s on one core for the whole file (EXAMPLES
below: 5,360 examples in all). For a longer hunt, scale them, e.g.
`A3B_FUZZ_SCALE=20 pytest tests/test_fuzz.py`. Each engine bug they find gets a minimal case
in test_bad_inputs.py.
"""
from __future__ import annotations

import copy
import io
import json
import math
import os
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw
from safetensors.torch import save_file

from a3b_core import load_model
from a3b_core.errors import ChatTemplateError, CheckpointError, ConfigError, ImageError, PromptError
from a3b_core.media.image import MAX_INPUT_PIXELS, load_image
from a3b_core.models import load_config, parse_config
from a3b_core.prompting.built_in_templates import qwen3_5_prompt as build_prompt
from a3b_core.prompting.conversation import IMAGE_MARKER, Turn
from a3b_core.prompting.folder_template import FolderTemplate
from a3b_core.prompting.template_costs import RENDER_SECONDS
from a3b_core.prompting.tokenizer import Tokenizer, check_against_config
from a3b_core.release.config import MAX_LAYERS, ModelConfig
from a3b_core.release.safetensors import Checkpoint, read_header
from bench.soak import run_soak
from nodes.captions import save_captions
from tests.tiny_models import MOE_DIMS, TEXT_DIMS, TOKEN_IDS, VISION_DIMS
from tests.tiny_tokenizer import build_tiny_tokenizer

FUZZ_SCALE = int(os.environ.get("A3B_FUZZ_SCALE", "1"))
EXAMPLES = {"header_bytes": 300, "header_mutations": 800, "header_fields": 500, "config": 600, "config_numbers": 400,
            "tokenizer": 150, "prompt": 600, "template": 60, "image": 1000, "captions": 300}
DATA = Path(__file__).parent / "data"


def fuzz(name: str):
    return settings(max_examples=EXAMPLES[name] * FUZZ_SCALE, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """One file per fuzz target, rewritten by every example (hypothesis runs many examples per test call)."""
    return tmp_path_factory.mktemp("fuzz")


# A byte-level mutation: (where, as a fraction of the length; what; payload). Applied in order.
MUTATIONS = st.lists(st.tuples(st.floats(0, 1), st.sampled_from(["set", "delete", "insert"]),
                               st.binary(min_size=1, max_size=8)), min_size=1, max_size=8)


def mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for where, what, payload in mutations:
        at = min(int(where * len(out)), max(len(out) - 1, 0))
        if what == "set":
            out[at:at + len(payload)] = payload
        elif what == "delete":
            del out[at:at + len(payload)]
        else:
            out[at:at] = payload
    return bytes(out)


# ------------------------------------------------------------------------------------------- safetensors headers
def check_infos(infos: dict, path: Path) -> None:
    """What read_header promises about an accepted file: every tensor inside the data section, none overlapping.
    So nothing a header says can make the loader allocate more than the file holds."""
    size = path.stat().st_size
    spans = sorted((i.offset, i.offset + i.nbytes) for i in infos.values())
    assert all(8 <= start <= end <= size for start, end in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert sum(i.nbytes for i in infos.values()) <= size


@fuzz("header_bytes")
@given(data=st.binary(max_size=300))
def test_random_bytes_are_refused_as_safetensors(scratch, data):
    path = scratch / "random.safetensors"
    path.write_bytes(data)
    try:
        check_infos(read_header(path), path)
    except CheckpointError:
        pass


@pytest.fixture(scope="module")
def valid_checkpoint(scratch) -> bytes:
    """A small valid file with the dtypes a release holds: bf16, fp32, FP8 with its block scale, int64, empty."""
    path = scratch / "seed.safetensors"
    save_file({"a.weight": torch.randn(4, 6).to(torch.bfloat16), "a.bias": torch.randn(6),
               "q.weight": torch.randn(3, 5).to(torch.float8_e4m3fn), "q.weight_scale_inv": torch.ones(1, 1),
               "ids": torch.arange(3), "empty": torch.zeros(0, 4)}, path, metadata={"format": "pt"})
    return path.read_bytes()


@fuzz("header_mutations")
@given(mutations=MUTATIONS)
def test_mutated_safetensors_load_or_fail_clearly(scratch, valid_checkpoint, mutations):
    folder = scratch / "mutated"
    folder.mkdir(exist_ok=True)
    path = folder / "model.safetensors"
    path.write_bytes(mutate(valid_checkpoint, mutations))
    try:
        ckpt = Checkpoint(folder)
        check_infos(ckpt.infos, path)
        for name in ckpt.infos:
            ckpt.weight(name)
        ckpt.close()
    except CheckpointError:
        pass


DTYPE_NAMES = ["F32", "BF16", "F16", "F8_E4M3", "I64", "U8", "BOOL", "Q4_K", "", "f32"]
JSON_SCALARS = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8)
DIMENSION = st.integers(-2, 2**50) | JSON_SCALARS
ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(DTYPE_NAMES) | JSON_SCALARS,
    "shape": st.lists(DIMENSION, max_size=4) | JSON_SCALARS,
    "data_offsets": st.lists(st.integers(-4, 2**50) | JSON_SCALARS, max_size=3) | JSON_SCALARS,
})


@fuzz("header_fields")
@given(header=st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]), ENTRY | JSON_SCALARS, max_size=4),
       data_size=st.integers(0, 64))
def test_structured_headers_load_or_fail_clearly(scratch, header, data_size):
    path = scratch / "fields.safetensors"
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * data_size)
    try:
        check_infos(read_header(path), path)
    except CheckpointError:
        pass


# --------------------------------------------------------------------------------------------------- config.json
def check_config(cfg: ModelConfig) -> None:
    """What an accepted config must be: every number of the right type and range, and the fields consistent with
    each other, so that building and running the model cannot fail on it."""
    t = cfg.text
    positive = [t.vocab_size, t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim,
                t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim,
                t.linear_conv_kernel_dim, t.max_position_embeddings]
    assert all(type(v) is int and 0 < v < 2**31 for v in positive)
    assert t.num_layers <= MAX_LAYERS
    assert t.num_heads % t.num_kv_heads == 0 and t.linear_num_value_heads % t.linear_num_key_heads == 0
    assert len(t.layer_types) == t.num_layers and set(t.layer_types) <= {"full_attention", "linear_attention"}
    assert 2 <= t.rotary_dim <= t.head_dim and t.rotary_dim % 2 == 0
    assert all(type(s) is int and s >= 0 for s in t.mrope_section) and sum(t.mrope_section) == t.rotary_dim // 2
    assert math.isfinite(t.rope_theta) and t.rope_theta > 0
    assert math.isfinite(t.rms_norm_eps) and t.rms_norm_eps >= 0
    assert all(type(i) is int and 0 <= i < t.vocab_size for i in t.eos_token_ids)
    if t.is_moe:
        assert 0 < t.num_experts_per_tok <= t.num_experts
        assert t.moe_intermediate_size > 0 and t.shared_expert_intermediate_size > 0
    else:
        assert t.intermediate_size > 0
    tokens = [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id]
    assert all(type(i) is int and 0 <= i < 2**31 for i in tokens)
    if cfg.vision is not None:
        v = cfg.vision
        assert all(type(n) is int and n > 0 for n in (v.depth, v.hidden_size, v.num_heads, v.intermediate_size,
                                                      v.patch_size, v.spatial_merge_size, v.out_hidden_size))
        assert v.hidden_size % v.num_heads == 0 and v.depth <= MAX_LAYERS
    block = (cfg.quantization or {}).get("weight_block_size")
    assert not block or (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block))


RELEASE_CONFIGS = [json.loads((DATA / "qwen3_5_35b_a3b.config.json").read_text())]


def test_release_configs_are_valid():
    """The property below is not stricter than the real releases."""
    for raw in RELEASE_CONFIGS:
        check_config(parse_config(raw))


def paths_of(obj, prefix=()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield prefix + (key,)
            yield from paths_of(value, prefix + (key,))


JSON_VALUES = st.recursive(JSON_SCALARS | st.sampled_from(["full_attention", "default", "1e7", "qwen3_5_moe"]),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)


@fuzz("config")
@given(data=st.data())
def test_mutated_release_config_parses_or_fails_clearly(data):
    raw = copy.deepcopy(data.draw(st.sampled_from(RELEASE_CONFIGS)))
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    for _ in range(data.draw(st.integers(1, 3))):
        *parents, key = data.draw(st.sampled_from(sorted(paths_of(raw), key=str)))
        owner = raw
        for parent in parents:
            owner = owner.get(parent) if isinstance(owner, dict) else None
        if isinstance(owner, dict):
            if data.draw(st.booleans()):
                owner[key] = data.draw(JSON_VALUES)
            else:
                owner.pop(key, None)
    try:
        check_config(parse_config(raw))
    except ConfigError:
        pass


@fuzz("config")
@given(raw=st.dictionaries(st.sampled_from(["model_type", "text_config", "vision_config", "rope_parameters",
                                            "hidden_size", "num_hidden_layers", "partial_rotary_factor",
                                            "eos_token_id", "image_token_id"]), JSON_VALUES, max_size=6),
       model_type=st.sampled_from(["qwen3_5_moe", "qwen3_5", "qwen3_5_moe_text", "llama", None]))
def test_random_config_dicts_parse_or_fail_clearly(raw, model_type):
    raw = raw | ({"model_type": model_type} if model_type else {})
    try:
        check_config(parse_config(raw))
    except ConfigError:
        pass


def numeric_paths(obj, prefix=()):
    """Paths of every number in a JSON object (booleans are not numbers here)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from numeric_paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            yield from numeric_paths(value, prefix + (index,))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield prefix


# Python's json reads NaN, Infinity, 1e999 (as inf) and integers of any size; each must be refused or be harmless.
EXTREME_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, 0, -1, 0.5, 1.5, 1e-300, 1e300, 2**31, 2**63,
                                   10**30, 10**400]) | st.floats() | st.integers(-2**70, 2**70)


@fuzz("config_numbers")
@given(data=st.data())
def test_extreme_numbers_in_release_config_parse_or_fail_clearly(data):
    raw = copy.deepcopy(RELEASE_CONFIGS[0])
    for _ in range(data.draw(st.integers(1, 3))):
        *parents, key = data.draw(st.sampled_from(sorted(numeric_paths(raw), key=str)))
        owner = raw
        for parent in parents:
            owner = owner[parent]
        owner[key] = data.draw(EXTREME_NUMBERS)
    try:
        check_config(parse_config(raw))
    except ConfigError:
        pass


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 5000, "-" + "9" * 5000,
                                     "1" + "0" * 400, "0.0", "1e-400"])
def test_every_number_of_the_release_config_file_can_be_extreme(tmp_path, literal):
    """The same through the file: each number of config.json's text replaced by a literal json.loads accepts (or
    chokes on); a valid config or a ConfigError, never another exception."""
    raw = RELEASE_CONFIGS[0]
    for path in sorted(numeric_paths(raw), key=str):
        edited = copy.deepcopy(raw)
        owner = edited
        for parent in path[:-1]:
            owner = owner[parent]
        owner[path[-1]] = "@@"
        (tmp_path / "config.json").write_text(json.dumps(edited).replace('"@@"', literal))
        try:
            check_config(load_config(tmp_path))
        except ConfigError:
            pass


# --------------------------------------------------------------------------------------------- tokenizer.json
TINY_CONFIG = parse_config({"model_type": "qwen3_5_moe", "text_config": {**TEXT_DIMS, **MOE_DIMS},
                            "vision_config": VISION_DIMS, **TOKEN_IDS})
TINY_TOKENIZER = json.loads(build_tiny_tokenizer().to_str())
ADDED = [t["content"] for t in TINY_TOKENIZER["added_tokens"]]
TRUNCATION = st.none() | st.fixed_dictionaries({
    "direction": st.sampled_from(["Right", "Left"]), "max_length": st.integers(0, 64),
    "strategy": st.sampled_from(["LongestFirst", "OnlyFirst", "OnlySecond"]), "stride": st.integers(0, 4)})
PADDING = st.none() | st.fixed_dictionaries({
    "strategy": st.sampled_from(["BatchLongest"]) | st.builds(lambda n: {"Fixed": n}, st.integers(0, 300)),
    "direction": st.sampled_from(["Right", "Left"]), "pad_to_multiple_of": st.none() | st.integers(1, 16),
    "pad_id": st.integers(0, 600), "pad_type_id": st.integers(0, 2), "pad_token": st.sampled_from(["!", "<|im_end|>"])})
# (which added token, what happens to it): dropped, renamed to another added token's text, its special flag flipped,
# or its id moved.
EDITS = st.lists(st.tuples(st.sampled_from(ADDED), st.sampled_from(["drop", "rename", "flip", "renumber"]),
                           st.sampled_from(ADDED), st.integers(0, 520)), max_size=3)


def edit_added_tokens(tokenizer: dict, edits) -> None:
    for content, action, other, new_id in edits:
        for token in list(tokenizer["added_tokens"]):
            if token["content"] != content:
                continue
            if action == "drop":
                tokenizer["added_tokens"].remove(token)
            elif action == "rename":
                token["content"] = other
            elif action == "flip":
                token["special"] = not token["special"]
            else:
                token["id"] = new_id


@fuzz("tokenizer")
@given(truncation=TRUNCATION, padding=PADDING, edits=EDITS)
def test_edited_tokenizer_json_loads_checked_or_fails_clearly(scratch, truncation, padding, edits):
    """An accepted tokenizer.json keeps every promise: it neither cuts nor pads, holds the chat template's control
    tokens, and agrees with config.json on the vision and end-of-text ids."""
    data = copy.deepcopy(TINY_TOKENIZER) | {"truncation": truncation, "padding": padding}
    edit_added_tokens(data, edits)
    folder = scratch / "tokenizer"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    try:
        tokenizer = Tokenizer.from_folder(folder)
        check_against_config(tokenizer, TINY_CONFIG, "config.json")
    except (CheckpointError, ConfigError):
        return
    text = "The quick brown fox jumps over the lazy dog. " * 3
    assert tokenizer.decode(tokenizer.encode(text)) == text
    for token, expected in (("<|image_pad|>", TINY_CONFIG.image_token_id),
                            ("<|vision_start|>", TINY_CONFIG.vision_start_token_id),
                            ("<|vision_end|>", TINY_CONFIG.vision_end_token_id)):
        assert tokenizer.token_id(token) == expected
    assert {"<|im_start|>", "<|im_end|>"} <= tokenizer.control_tokens
    assert all(tokenizer.backend.id_to_token(i) in tokenizer.control_tokens for i in TINY_CONFIG.text.eos_token_ids)
    assert tokenizer.vocab_size <= TINY_CONFIG.text.vocab_size


# ------------------------------------------------------------------------------------------------- prompt text
@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer())


PIECES = st.sampled_from([IMAGE_MARKER, "[[IMG", "IMG]]", "[[", "]]", "<|im_start|>", "<|im_end|>", "<think>",
                          "</think>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "\n", " ", "\0", "é",
                          "🙂", "Describe"])
TEXTS = st.lists(PIECES | st.text(max_size=6), max_size=8).map("".join)


def check_prompt(tok: Tokenizer, prompt, counts: list[int]) -> None:
    """An accepted prompt holds each image once, as exactly its number of pad tokens between its own delimiters."""
    ids = list(prompt.input_ids)
    start, pad, end = (tok.token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    assert ids.count(pad) == sum(counts) and ids.count(start) == ids.count(end) == len(counts)
    for count in counts:
        opened = ids.index(start)
        assert ids[opened + 1:opened + 2 + count] == [pad] * count + [end]
        ids = ids[opened + 2 + count:]
    assert prompt.image_token_counts == tuple(counts)


@fuzz("prompt")
@given(user=TEXTS, system=st.none() | TEXTS, turns=st.lists(st.tuples(TEXTS, TEXTS, st.integers(0, 2)), max_size=2),
       counts=st.lists(st.integers(1, 4), max_size=4), thinking=st.booleans(), add_vision_id=st.booleans())
def test_prompts_build_or_fail_clearly(tok, user, system, turns, counts, thinking, add_vision_id):
    history = [Turn(u, a, num_images=n) for u, a, n in turns]
    try:
        prompt = build_prompt(tok, user, system=system, image_token_counts=counts, thinking=thinking,
                              history=history, add_vision_id=add_vision_id)
    except PromptError:
        return
    check_prompt(tok, prompt, counts)


@fuzz("prompt")
@given(user=st.lists(PIECES | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                     max_size=6).map("".join))
def test_prompts_with_lone_surrogates_build_or_fail_clearly(tok, user):
    try:
        build_prompt(tok, user)
    except PromptError:
        pass


# ------------------------------------------------------------------------------------------------ chat templates
# A folder template that starts from a value and applies growing steps to it many times: every operator, filter and
# method that builds a string or list, fed its own output.
TEMPLATE_STARTS = ["'x'", "'ab ' * 1000", "[1, 'a']", "range(50)|list", "messages", "{'k': 'v'}", "7", "2 ** 40",
                   "'%s {} %s'", "namespace(v='é')"]
TEMPLATE_STEPS = ["({v}) ~ ({v})", "({v}) + ({v})", "({v}) * 1000", "({v}) * ({v})", "'%s%s' % (({v}), ({v}))",
                  "'{{:>{{}}}}{{}}'.format(({v}), 100000, ({v}))", "({v})|center(100000)", "({v})|list", "({v})|sort",
                  "({v})|string", "({v})|tojson(indent=4)", "({v})|replace('a', ({v}))", "({v})|batch(3)|list",
                  "({v})[::-1]", "({v})|indent(100)", "({v})|join(({v}))", "(({v})|string).split(' ')",
                  "[({v}), ({v})]", "({v})|format(({v}))", "({v})|unique|list", "({v})|wordwrap(3)",
                  "(({v})|string).center(99999)", "({v})|map('string')|list", "({v})|items|list",
                  "(({v})|string).format(({v}))"]
TEMPLATE_PEAK_BYTES = 128 * 2**20


@fuzz("template")
@given(start=st.sampled_from(TEMPLATE_STARTS), steps=st.lists(st.sampled_from(TEMPLATE_STEPS), min_size=1, max_size=3),
       repeat=st.integers(1, 40))
def test_growing_templates_render_or_fail_clearly_within_bounds(tok, start, steps, repeat):
    """Rendered text or a ChatTemplateError, never another exception, with the render's allocations (tracemalloc's
    peak) and CPU time bounded whatever the steps."""
    body = "".join(f"{{% set ns.v = {step.format(v='ns.v')} %}}" for step in steps)
    source = f"{{% set ns = namespace(v={start}) %}}{{% for i in range({repeat}) %}}{body}{{% endfor %}}{{{{ ns.v }}}}"
    tracemalloc.start()
    started = time.thread_time()
    try:
        FolderTemplate(source, Path("chat_template.jinja"), "chat_template.jinja").build_prompt(tok, "Hi")
    except ChatTemplateError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.thread_time() - started < 3 * RENDER_SECONDS
    assert peak < TEMPLATE_PEAK_BYTES, f"{peak / 2**20:.0f} MiB"


# ------------------------------------------------------------------------------------------------- image files
def seed_images() -> dict[str, bytes]:
    """Small valid files in the formats users send: PNG (with EXIF rotation), JPEG (with EXIF), GIF (animated),
    WebP, TIFF, BMP."""
    img = Image.new("RGB", (24, 16), "white")
    ImageDraw.Draw(img).rectangle((2, 2, 12, 10), fill="red")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate
    seeds = {}
    for name, fmt, options in [("png", "PNG", {"exif": exif.tobytes()}), ("jpeg", "JPEG", {"exif": exif.tobytes()}),
                               ("gif", "GIF", {"save_all": True, "append_images": [img.rotate(90)]}),
                               ("webp", "WEBP", {}), ("tiff", "TIFF", {}), ("bmp", "BMP", {})]:
        out = io.BytesIO()
        img.save(out, format=fmt, **options)
        seeds[name] = out.getvalue()
    return seeds


SEED_IMAGES = seed_images()


@fuzz("image")
@given(seed=st.sampled_from(sorted(SEED_IMAGES)), mutations=MUTATIONS)
def test_mutated_images_decode_or_fail_clearly(scratch, seed, mutations):
    path = scratch / "image.bin"
    path.write_bytes(mutate(SEED_IMAGES[seed], mutations))
    try:
        img = load_image(path)
    except ImageError:
        return
    assert img.mode == "RGB" and 0 < img.width * img.height <= MAX_INPUT_PIXELS


# ------------------------------------------------------------------------------------------- caption file paths
OUTSIDE = "<outside>"  # stands for the absolute path of a folder beside the output folder
PATH_PIECES = st.sampled_from(["a", "é", ".", "..", "/", "\\", ":", "C:", "\0", " ", "\n", ".txt", ".png", "link",
                               "file", "deep", "x" * 120, OUTSIDE])
# No leading "/", and the folders below lie deeper than a subfolder and a prefix of 8 pieces each can climb with
# '..' (through a link too): should a regression let a path out, it lands in the test's folder, not in the real root.
PATH_TEXTS = st.lists(PATH_PIECES, max_size=8).map("".join).map(lambda text: text.lstrip("/"))
CLIMB = 16


@pytest.fixture(scope="module")
def caption_folders(scratch) -> tuple[Path, Path, Path]:
    """An output folder holding links out of it (a folder link, a file link, a dangling link) to `outside`, its
    sibling; and the folder CLIMB levels above both."""
    top = scratch / "captions"
    output, outside = (top.joinpath(*["up"] * CLIMB, name) for name in ("output", "outside"))
    (output / "deep").mkdir(parents=True)
    outside.mkdir()
    (outside / "victim.txt").write_text("mine\n")
    (output / "link").symlink_to(outside, target_is_directory=True)
    (output / "file.txt").symlink_to(outside / "victim.txt")
    (output / "deep" / "a.txt").symlink_to(outside / "new.txt")
    return top, output, outside


def files_outside(top: Path, output: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in top.rglob("*") if p.is_file() and not p.is_relative_to(output)}


@fuzz("captions")
@given(subfolder=PATH_TEXTS, names=st.lists(PATH_TEXTS, max_size=3).map("\n".join), prefix=PATH_TEXTS,
       count=st.integers(1, 3))
def test_caption_files_never_land_outside_the_output_folder(caption_folders, subfolder, names, prefix, count):
    top, output, outside = caption_folders
    subfolder, names, prefix = (text.replace(OUTSIDE, str(outside)) for text in (subfolder, names, prefix))
    before = files_outside(top, output)
    try:
        summary = save_captions(output, ["a knight"] * count, subfolder, names, prefix, "", overwrite=True)
    except ConfigError:
        summary = ""
    assert files_outside(top, output) == before
    folder, *saved = summary.splitlines() or [""]
    for line in saved:
        assert (Path(folder) / line.removeprefix("saved: ")).resolve().is_relative_to(output.resolve())


# ------------------------------------------------------------------------------------------------- repetition
def test_short_soak_leaves_no_cache_and_memory_levels_off(fixtures):
    """One period of bench/soak.py's mix (15 generations: text, images, thinking, Stop): no Cache or EncodedImages
    outlives its call, and RSS after the warm-up sample stays within a generous 25% (the benchmark's 300 runs hold
    it to 5%)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run_soak(load_model(fixtures.moe_fused_bf16, preset="cpu", compute_dtype="float32"), 15, 5)
    finally:
        torch.set_num_threads(threads)
    assert report.cancelled == 3 and report.image_prompts == 5  # the mix ran as designed
    assert not report.leaked, report.samples
    assert report.growth < 0.25, report.samples
