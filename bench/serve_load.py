"""Load test of `python -m a3b_core serve` on the demo model: requests per second and time to first token for 1, 4
and 16 concurrent clients, once with the server batching requests (its default) and once decoding one request at a
time (--max-batch-size 1), and the ratio of the two throughputs.

    python bench/serve_load.py                  # 64 requests per run
    python bench/serve_load.py --requests 128

Each client sends its requests back to back over loopback: a caption request for one of the four pixel-art workflow
inputs (a PNG data URL), greedy, thinking off, streamed; the time to first token is measured at the client, from
sending the request to the first streamed text. The table is printed with the machine it ran on.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: a3b_core, tests

import aiohttp  # noqa: E402

from bench.machine import cpu_description  # noqa: E402
from tests.integration.pixel_art_inputs import INPUTS  # noqa: E402
from tests.served import start_served  # noqa: E402

CLIENTS = (1, 4, 16)
REQUEST_TIMEOUT_S = 300


def request_bodies() -> list[dict]:
    bodies = []
    for path in sorted(INPUTS.glob("a3b_pixel_*.png")):
        url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
        bodies.append({"model": "a3b-demo", "stream": True, "max_tokens": 32, "temperature": 0,
                       "chat_template_kwargs": {"enable_thinking": False},
                       "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                 {"type": "text", "text": "Describe the image."}]}]})
    return bodies


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    """Sends one streamed request; returns its time to first token."""
    started = time.perf_counter()
    first = None
    async with session.post(url + "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("a request streamed no text")
    return first


async def load(url: str, clients: int, requests: int) -> tuple[float, list[float]]:
    """`requests` requests from `clients` concurrent clients; returns (seconds, times to first token)."""
    bodies = request_bodies()
    counter = iter(range(requests))
    ttfts: list[float] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)

    async def client(session: aiohttp.ClientSession) -> None:
        for number in counter:
            ttfts.append(await one_request(session, url, bodies[number % len(bodies)]))

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return time.perf_counter() - started, ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per run (default: 64)")
    args = parser.parse_args()
    results: dict[tuple[str, int], tuple[float, list[float], list[int]]] = {}
    with tempfile.TemporaryDirectory() as work:
        for mode, extra in (("batched", []), ("one at a time", ["--max-batch-size", "1"])):
            served = start_served(Path(work), *extra)
            try:
                asyncio.run(load(served.url, 2, 4))  # warm-up: first-use allocations, image path, thread pools
                for clients in CLIENTS:
                    before = len(served.log_text())
                    seconds, ttfts = asyncio.run(load(served.url, clients, args.requests))
                    batches = [int(n) for n in re.findall(r"batch of (\d+)", served.log_text()[before:])]
                    results[mode, clients] = seconds, ttfts, batches
            finally:
                served.stop()
    print(f"python bench/serve_load.py --requests {args.requests}: a3b-demo on {cpu_description()}, {os.cpu_count()} "
          "cores; each request: one 384x384 image + 'Describe the image.', greedy, streamed, ~15 tokens")
    print("| clients | batched req/s | one at a time req/s | ratio | TTFT median batched | TTFT median one at a "
          "time | mean batch (batched) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for clients in CLIENTS:
        batched, single = results["batched", clients], results["one at a time", clients]
        rates = [args.requests / run[0] for run in (batched, single)]
        print(f"| {clients} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[0] / rates[1]:.2f}x | "
              f"{statistics.median(batched[1]) * 1000:.0f} ms | {statistics.median(single[1]) * 1000:.0f} ms | "
              f"{statistics.mean(batched[2]):.1f} |")
    print(json.dumps({f"{mode}/{clients}": {"seconds": round(run[0], 3),
                                            "ttft_median_s": round(statistics.median(run[1]), 4),
                                            "ttft_p90_s": round(statistics.quantiles(run[1], n=10)[-1], 4),
                                            "mean_batch": round(statistics.mean(run[2]), 2)}
                      for (mode, clients), run in results.items()}))


if __name__ == "__main__":
    main()
