"""Hostile inputs the image, server and caption-folder tests share, and how those tests measure what a process does:
PostScript that Pillow's EPS plugin would hand to Ghostscript, a stand-in `gs` that leaves a marker when anything
runs it, PNGs that are tiny files but huge images, and a process's peak memory."""
from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]
# A valid EPS file: Pillow identifies it, and decoding it runs Ghostscript.
EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n%%EndComments\n"
       b"newpath 0 0 moveto 16 16 lineto stroke\nshowpage\n%%EOF\n")


def fake_ghostscript(folder: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PATH finds first a `gs` in `folder` that only creates a marker file, and that marker's
    path: the marker exists once any program has run `gs`."""
    marker = folder / "gs-ran"
    gs = folder / "gs"
    gs.write_text(f"#!/bin/sh\ntouch '{marker}'\nexit 1\n")
    gs.chmod(0o755)
    return dict(os.environ, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}"), marker


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (1-bit grey) with a tiny IDAT: cheap to write, huge if decoded."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def blank_png(width: int, height: int) -> bytes:
    """A real, decodable 1-bit PNG of width x height: a few KB however large (11500x11500 is 16 KB)."""
    data = io.BytesIO()
    Image.new("1", (width, height)).save(data, format="PNG")
    return data.getvalue()


def child_peak_growth(script: str, env: dict[str, str] | None = None) -> int:
    """Bytes by which `script`'s part after the line '# measure' raises the peak memory (max RSS) of a child Python
    process that runs it from the repository."""
    setup, _, measured = script.partition("# measure\n")
    program = (f"import resource\n{setup}\nbefore = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n{measured}\n"
               "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux


def reset_peak(pid: int) -> None:
    """Sets the process's peak resident memory (VmHWM) back to what it holds now (Linux)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in KiB."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: int(value.split()[0]) for key, _, value in (line.partition(":") for line in lines)
            if key in ("VmRSS", "VmHWM")}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
