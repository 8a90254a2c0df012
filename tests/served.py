"""Starts `python -m a3b_core serve` as its own process on a free loopback port, as a user would, and reads its log."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.integration.comfy_server import stop_process

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300  # loading the model under a busy machine (other test processes, benchmarks) can take minutes
READY = re.compile(r"A3B server: \S+ at (http://\S+/v1) ")


@dataclass
class Served:
    process: subprocess.Popen
    log_path: Path
    url: str = ""  # the OpenAI base URL, ending in /v1

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        with urllib.request.urlopen(self.root + "/health", timeout=30) as response:
            return json.loads(response.read())

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """/health once nothing runs or waits; fails after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.health()
            if health["running"] == 0 and health["waiting"] == 0:
                return health
            assert time.monotonic() < deadline, f"the server is still busy after {timeout_s} s: {health}"
            time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.process)


def start_served(log_dir: Path, *args: str, model: str = "a3b-demo", env: dict | None = None) -> Served:
    """The server for `model` with extra command-line `args`; returns once it listens."""
    log_path = log_dir / "serve.log"
    command = [sys.executable, "-m", "a3b_core", "serve", model, "--port", "0", *args]
    environment = dict(os.environ, PYTHONUNBUFFERED="1") | (env or {})
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT)
    served = Served(process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = READY.search(served.log_text())
        if found:
            served.url = found.group(1)
            return served
        if process.poll() is not None:
            raise AssertionError(f"the server exited with code {process.returncode}:\n{served.log_text()}")
        time.sleep(0.1)
    served.stop()
    raise AssertionError(f"the server did not start within {START_TIMEOUT_S} s:\n{served.log_text()}")
