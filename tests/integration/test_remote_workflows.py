"""A3B Remote Model in a real ComfyUI, pointed at `python -m a3b_core serve`: the shipped workflows give the local demo
model's answers (greedy; the pixel-art workflow's folder captions too), Stop cancels the server's generation, and a
wrong address fails with a clear message."""
from __future__ import annotations

import copy
import re

import pytest

from tests.integration.comfy_server import ComfyServer
from tests.integration.conftest import error_message, load_api_workflow
from tests.integration.pixel_art_inputs import expected_captions
from tests.integration.test_workflows import GENERATE_WORKFLOWS, _nodes, _set_inputs, _succeeded
from tests.served import Served, start_served
from tests.tiny_models import build_fixtures

pytestmark = pytest.mark.comfyui

GREEDY = {"temperature": 0.0, "presence_penalty": 0.0}


@pytest.fixture(scope="module")
def demo_server(comfy, tmp_path_factory) -> Served:
    server = start_served(tmp_path_factory.mktemp("serve-demo"))
    yield server
    server.stop()


def remote_graph(graph: dict, url: str) -> dict:
    """`graph` with its A3B Model Loader replaced by an A3B Remote Model for the server at `url`."""
    graph = copy.deepcopy(graph)
    for node_id in _nodes(graph, "A3BModelLoader"):
        graph[node_id] = {"class_type": "A3BRemoteModel",
                          "inputs": {"base_url": url, "model": "", "api_key_env": "", "timeout": 300}}
    return graph


VIDEO_WORKFLOW = "video_lora_captioning"  # clips are read by the local engine only


@pytest.mark.parametrize("name", [name for name in GENERATE_WORKFLOWS if name != VIDEO_WORKFLOW])
def test_a_shipped_workflow_gives_the_local_answers_through_the_remote_model(comfy: ComfyServer,
                                                                            demo_server: Served, name: str) -> None:
    local = _set_inputs(load_api_workflow(name, model="a3b-demo"), "A3BGenerate", seed=301, **GREEDY)
    (generate,) = _nodes(local, "A3BGenerate")
    answers, speeds = [], []
    for graph in (local, remote_graph(local, demo_server.url)):
        entry = comfy.run(graph)
        _succeeded(comfy, entry)
        answers.append(entry["outputs"][generate]["a3b_answer"])
        speeds += entry["outputs"][generate]["a3b_speed"]
    assert answers[1] == answers[0] and all(answer.strip() for answer in answers[0])
    assert all(speed.startswith("TTFT ") and " · stopped: eos" in speed for speed in speeds), speeds


def test_the_video_workflow_on_a_remote_model_says_to_use_a_local_one(comfy: ComfyServer,
                                                                    demo_server: Served) -> None:
    entry = comfy.run(remote_graph(load_api_workflow(VIDEO_WORKFLOW, model="a3b-demo"), demo_server.url))
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert message.startswith("a3b_core.errors.RemoteError: ") and "does not take videos" in message
    assert "Connect an A3B Model Loader" in message


def test_the_pixel_art_workflow_captions_its_folder_through_the_remote_model(comfy: ComfyServer,
                                                                            demo_server: Served) -> None:
    # A server does not tell its model folder's captioning request, so both runs name the demo model's own.
    shipped = _set_inputs(load_api_workflow("pixel_art_lora_captioning", model="a3b-demo"), "A3BCaptionFolder",
                          prompt="Describe the image.")
    (preview,) = _nodes(shipped, "PreviewAny")
    captions = {}
    for where, graph in (("local", shipped), ("remote", remote_graph(shipped, demo_server.url))):
        graph = _set_inputs(graph, "A3BCaptionFolder", output_subfolder=f"a3b_captions/pixel_art_{where}_model")
        entry = comfy.run(graph)
        _succeeded(comfy, entry)
        captions[where] = entry["outputs"][preview]["text"]
    expected = [f"pxlart, {caption}" for _, caption in sorted(expected_captions().items())]
    assert captions["remote"] == captions["local"] == expected


def test_stop_cancels_the_generation_on_the_server(comfy: ComfyServer, tmp_path_factory) -> None:
    # The tiny test model writes for ~400 tokens before its end token: long enough to press Stop in the middle.
    server = start_served(tmp_path_factory.mktemp("serve-tiny"), model=str(build_fixtures().moe_fused_bf16))
    try:
        graph = _set_inputs(remote_graph(load_api_workflow("storyboard_shot_list"), server.url), "A3BGenerate",
                            max_new_tokens=20000, seed=401, mode="single", **GREEDY)  # one request: all panels
        (generate,) = _nodes(graph, "A3BGenerate")
        entry, live = comfy.run_watching(graph, interrupt_after_text_from=generate)
        kinds = [kind for kind, _ in entry["status"]["messages"]]
        assert "execution_interrupted" in kinds, f"the generation was not interrupted: {kinds}"
        assert any(node_id == generate for node_id, _ in live)  # the answer streamed onto the node first
        server.wait_idle()
        cancelled = re.findall(r"(\d+) new tokens, cancelled, batch of 1 \(client gone\)", server.log_text())
        assert len(cancelled) == 1 and int(cancelled[0]) < 20000, server.log_text()
    finally:
        server.stop()


def test_a_server_that_is_not_there_fails_with_a_clear_message(comfy: ComfyServer) -> None:
    graph = remote_graph(load_api_workflow("storyboard_shot_list"), "http://127.0.0.1:9/v1")
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "error"
    message = error_message(entry)
    assert message.startswith("a3b_core.errors.RemoteError: cannot reach http://127.0.0.1:9/v1/models"), message
