"""One real ComfyUI server for the whole integration session (select these tests with `pytest -m comfyui`)."""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.comfy_server import REPO, ComfyServer, comfyui_missing_reason, prepare_base, start_server
from tests.tiny_models import build_fixtures

TINY_MODEL = "tiny-a3b"  # the tiny test checkpoint as it appears in models/LLM
BROKEN_MODEL = "broken-a3b"  # a model folder with config and tokenizer but no weights
WORKFLOWS = REPO / "workflows"
# The tiny test model writes noise until a rare end token; runs are capped so the suite stays quick.
TEST_MAX_NEW_TOKENS = 48


def require_comfyui() -> None:
    reason = comfyui_missing_reason()
    if reason is None:
        return
    if os.environ.get("CI"):  # CI installs ComfyUI first; a missing install there is a failure, not a skip
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def comfy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComfyServer]:
    require_comfyui()
    tiny_model_dir = build_fixtures().moe_fused_bf16
    work = tmp_path_factory.mktemp("comfyui")
    broken = work / BROKEN_MODEL
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, broken / name)
    base = work / "base"
    prepare_base(base, {TINY_MODEL: tiny_model_dir, BROKEN_MODEL: broken}, WORKFLOWS / "inputs")
    server = start_server(base)
    try:
        yield server
    finally:
        server.stop()


def load_api_workflow(name: str, model: str = TINY_MODEL) -> dict:
    """An API-format workflow as shipped, with the loader pointed at `model`."""
    graph = json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())
    for node in graph.values():
        if node["class_type"] == "A3BModelLoader":
            node["inputs"]["model"] = model
    return graph


def caption_file_names(graph: dict, save_id: str) -> list[str]:
    """The file names A3B Save Captions `save_id` of an API graph names its caption files after: the lines of its
    names text, or, when names comes from A3B Video Encode, the file of the Load Video that feeds it."""
    names = graph[save_id]["inputs"]["names"]
    if isinstance(names, str):
        return [line for line in names.splitlines() if line.strip()]
    encode = graph[names[0]]
    assert encode["class_type"] == "A3BVideoEncode" and names[1] == 1, names
    return [graph[encode["inputs"]["video"][0]]["inputs"]["file"]]


def error_message(entry: dict) -> str:
    """The exception message ComfyUI recorded for a failed prompt ('' if none)."""
    for kind, data in entry["status"]["messages"]:
        if kind == "execution_error":
            return f"{data['exception_type']}: {data['exception_message']}"
    return ""
