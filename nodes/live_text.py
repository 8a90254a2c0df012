"""The text shown on the Generate node while it streams: one answer, or one section per image in per-image mode."""
from __future__ import annotations

import time
from collections.abc import Callable

_MIN_INTERVAL_S = 0.1  # at most ~10 redraws a second; each send carries the whole text so far


class LiveText:
    """Collects the text so far of each sequence and sends the combined view, throttled, to `send`."""

    def __init__(self, count: int, send: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self._texts = [""] * count
        self._send = send
        self._clock = clock
        self._last_sent = float("-inf")
        self.updates = 0  # streamed chunks so far, over all sequences (drives the progress bar)

    def update(self, index: int, text_so_far: str) -> None:
        self._texts[index] = text_so_far
        self.updates += 1
        now = self._clock()
        if now - self._last_sent >= _MIN_INTERVAL_S:
            self._last_sent = now
            self._send(self.render())

    def finish(self, texts: list[str]) -> None:
        """Shows the final answers, whatever the throttle skipped."""
        self._texts = list(texts)
        self._send(self.render())

    def render(self) -> str:
        if len(self._texts) == 1:
            return self._texts[0]
        return "\n\n".join(f"[image {number}]\n{text}" for number, text in enumerate(self._texts, start=1))
