"""Starts and talks to a real ComfyUI 0.3.75 server (installed by .ci/comfyui.sh) with this checkout as a custom node."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CI_CACHE = Path(os.environ.get("A3B_CI_CACHE", Path.home() / ".cache" / "a3b-ci"))
COMFYUI_DIR = Path(os.environ.get("A3B_COMFYUI_DIR", CI_CACHE / "comfyui"))
NODE_MODULES = CI_CACHE / "node" / "node_modules"
CHROMIUM = Path("/usr/bin/chromium")
PACK_NAME = "a3b_nodes"
START_TIMEOUT_S = 180
RUN_TIMEOUT_S = 300


def comfyui_missing_reason() -> str | None:
    if not (COMFYUI_DIR / "main.py").is_file():
        return f"ComfyUI 0.3.75 is not installed in {COMFYUI_DIR}; run `bash .ci/comfyui.sh {sys.executable}`"
    try:
        import aiohttp  # noqa: F401  (one of ComfyUI's requirements)
    except ImportError:
        return f"ComfyUI's requirements are not installed in {sys.executable}; run `bash .ci/comfyui.sh`"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ComfyServer:
    base: Path
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output_dir(self) -> Path:
        return self.base / "output"

    def request(self, method: str, path: str, body: object = None) -> tuple[int, object]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        try:
            return status, json.loads(raw or b"null")
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def get(self, path: str) -> object:
        status, body = self.request("GET", path)
        assert status == 200, f"GET {path} -> {status}: {body}"
        return body

    def queue(self, graph: dict, client_id: str | None = None) -> str:
        body = {"prompt": graph} | ({"client_id": client_id} if client_id else {})
        status, answer = self.request("POST", "/prompt", body)
        assert status == 200, f"/prompt refused the graph ({status}): {json.dumps(answer, indent=1)}"
        return answer["prompt_id"]

    def wait(self, prompt_id: str, timeout_s: float = RUN_TIMEOUT_S) -> dict:
        """The /history entry of a finished prompt (success, error or interrupted)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry:  # ComfyUI writes the history entry once the prompt has finished, however it ended
                return entry
            self.assert_alive()
            time.sleep(0.25)
        raise AssertionError(f"prompt {prompt_id} did not finish within {timeout_s} s\n{self.log_tail()}")

    def run(self, graph: dict, timeout_s: float = RUN_TIMEOUT_S) -> dict:
        return self.wait(self.queue(graph), timeout_s)

    def run_watching(self, graph: dict, interrupt_after_text_from: str | None = None) -> tuple[dict, list]:
        """Runs `graph` while listening on the websocket as the frontend does. Returns the /history entry and the
        live text messages [(node_id, text)]; with `interrupt_after_text_from`, POSTs /interrupt as soon as that node
        has streamed its first text."""
        return asyncio.run(asyncio.wait_for(self._watch(graph, interrupt_after_text_from), RUN_TIMEOUT_S))

    async def _watch(self, graph: dict, interrupt_node: str | None) -> tuple[dict, list]:
        import aiohttp  # one of ComfyUI's requirements, so present wherever these tests run

        client_id, live, interrupted = uuid.uuid4().hex, [], False
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(f"{self.url}/ws?clientId={client_id}") as ws:
                prompt_id = await asyncio.to_thread(self.queue, graph, client_id)
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        node_id, text = _progress_text(message.data)
                        if node_id is None:
                            continue
                        live.append((node_id, text))
                        if node_id == interrupt_node and not interrupted:
                            interrupted = True
                            await session.post(f"{self.url}/interrupt")
                    elif message.type == aiohttp.WSMsgType.TEXT:
                        event = json.loads(message.data)
                        if event["type"] in ("execution_success", "execution_error", "execution_interrupted") \
                                and event["data"].get("prompt_id") == prompt_id:
                            break
        return await asyncio.to_thread(self.wait, prompt_id), live

    def assert_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"ComfyUI exited with code {self.process.returncode}\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_text()[-chars:]

    def wait_for_log(self, text: str, occurrences: int = 1, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.log_text().count(text) < occurrences:
            self.assert_alive()
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} did not appear {occurrences} times in the log\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self) -> None:
        stop_process(self.process)


def stop_process(process: subprocess.Popen) -> None:
    """Ends a server process: SIGTERM, then SIGKILL after 20 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _progress_text(data: bytes) -> tuple[str | None, str]:
    """Decodes ComfyUI's binary progress_text message: event 3, node id length, node id, text."""
    event, = struct.unpack(">I", data[:4])
    if event != 3:
        return None, ""
    length, = struct.unpack(">I", data[4:8])
    return data[8:8 + length].decode(), data[8 + length:].decode()


def prepare_base(base: Path, models: dict[str, Path], inputs: Path) -> None:
    """A ComfyUI base directory: this checkout as a custom node, model folders in models/LLM, the folder `inputs`
    (with its subfolders) as ComfyUI's input folder."""
    (base / "custom_nodes").mkdir(parents=True)
    (base / "custom_nodes" / PACK_NAME).symlink_to(REPO, target_is_directory=True)
    llm = base / "models" / "LLM"
    llm.mkdir(parents=True)
    for name, folder in models.items():
        (llm / name).symlink_to(folder, target_is_directory=True)
    shutil.copytree(inputs, base / "input")
    (base / "output").mkdir()
    (base / "user").mkdir()


def start_server(base: Path) -> ComfyServer:
    port = free_port()
    log_path = base / "comfyui.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
               "--disable-auto-launch", "--base-directory", str(base), "--database-url", "sqlite:///:memory:",
               "--disable-api-nodes", "--log-stdout"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=COMFYUI_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = ComfyServer(base, port, process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        server.assert_alive()
        try:
            with urllib.request.urlopen(server.url + "/system_stats", timeout=5):
                return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    server.stop()
    raise AssertionError(f"ComfyUI did not answer /system_stats within {START_TIMEOUT_S} s\n{server.log_tail()}")
