"""llama.cpp for the comparison: its source from the llama-cpp-python sdist on PyPI, built once into the bench cache
(only llama-bench and llama-quantize), and the bench checkpoint converted by that tree's own converter.

Nothing here is part of the node pack: the build, the GGUF files and the tree stay in the bench cache.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.bench_model import bench_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-bench", "llama-quantize")
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno flags win over -march=native's
HERE = Path(__file__).resolve().parent


def binary(tree: Path, name: str) -> Path:
    return tree / "build" / "bin" / name


def is_built(tree: Path) -> bool:
    return all(binary(tree, name).is_file() for name in TARGETS)


def llama_tree(explicit: Path | None, jobs: int, no_amx: bool = False) -> Path:
    """The llama.cpp source tree with llama-bench and llama-quantize built in its `build/` folder: `explicit`
    (--llama-cpp or $A3B_LLAMA_CPP, which must already be built), else the bench cache's own copy, downloaded and
    built on first use (about 15 minutes on 2 cores). With `no_amx`, a copy of its own built without AMX
    instructions: on some virtual machines the CPU reports AMX but executing it is refused, and llama.cpp's native
    build then dies with SIGILL in its Q8_0 and Q4 kernels."""
    if explicit is not None:
        if not is_built(explicit):
            raise SystemExit(f"{explicit}: no build/bin/llama-bench and llama-quantize there. Build them "
                             "(cmake -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target llama-bench "
                             "llama-quantize) or drop --llama-cpp to let the bench build its own copy.")
        return explicit
    root = bench_dir() / ("llama.cpp-no-amx" if no_amx else "llama.cpp")
    tree = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if not is_built(tree):
        if not (tree / "CMakeLists.txt").is_file():
            download_sdist(root)
        build(tree, jobs, NO_AMX_FLAGS if no_amx else "")
    return tree


def download_sdist(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    archive = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not archive.is_file():
        print(f"[bench] downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(root),
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")


def build(tree: Path, jobs: int, flags: str) -> None:
    """A native build (-march=native) of TARGETS, with `flags` added to every C and C++ compile."""
    print(f"[bench] building {', '.join(TARGETS)} in {tree / 'build'} (about 15 minutes on 2 cores)", flush=True)
    subprocess.run(["cmake", "-S", str(tree), "-B", str(tree / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                    "-DLLAMA_OPENSSL=OFF", f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"], check=True)
    subprocess.run(["cmake", "--build", str(tree / "build"), "--config", "Release", "-j", str(jobs),
                    "--target", *TARGETS], check=True)


def gguf_files(tree: Path, model_dir: Path, types: list[str], threads: int) -> dict[str, Path]:
    """{type: path} for each requested type (bf16, q8_0, q4_0, f32, ...); BF16 comes from the converter, the rest
    from llama-quantize; all cached beside the checkpoint."""
    out_dir = bench_dir() / "gguf" / model_dir.name
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {t: out_dir / f"bench-{t}.gguf" for t in types}
    bf16 = out_dir / "bench-bf16.gguf"
    if not bf16.is_file():
        print(f"[bench] converting {model_dir} to {bf16}", flush=True)
        partial = bf16.with_suffix(".partial")
        run_logged([sys.executable, str(HERE / "convert_gguf.py"), str(tree), str(model_dir), str(partial)],
                   out_dir / "convert.log")
        partial.rename(bf16)
    for kind, path in files.items():
        if not path.is_file():
            print(f"[bench] quantizing to {kind}: {path}", flush=True)
            partial = path.with_suffix(".partial")
            run_logged([str(binary(tree, "llama-quantize")), str(bf16), str(partial), kind.upper(), str(threads)],
                       out_dir / f"quantize-{kind}.log")
            partial.rename(path)
    return files


def run_logged(command: list[str], log: Path) -> None:
    """Runs a chatty tool with its output in `log`; a failure raises with the log's tail."""
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed ({code}); its log {log} ends:\n{log.read_text()[-3000:]}")


def gguf_tensor_bytes(tree: Path, path: Path) -> list[tuple[str, int]]:
    """(name, bytes) of every tensor in a GGUF file, read with the tree's own gguf-py."""
    sys.path.insert(0, str(tree / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.remove(str(tree / "gguf-py"))
    return [(t.name, int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors]


def bench_command(tree: Path, gguf: Path, prefill: int, decode: int, threads: int) -> list[str]:
    """One repetition of llama-bench's pp and tg tests (the caller repeats it, interleaved with the other systems);
    JSON on stdout."""
    return [str(binary(tree, "llama-bench")), "-m", str(gguf), "-p", str(prefill), "-n", str(decode),
            "-t", str(threads), "-r", "1", "-o", "json"]


def parse_bench(stdout: str) -> dict:
    """{prefill_tok_s, decode_tok_s} from llama-bench's JSON."""
    rows = json.loads(stdout)
    pp = next(r for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(r for r in rows if r["n_gen"] and not r["n_prompt"])
    return dict(prefill_tok_s=pp["avg_ts"], decode_tok_s=tg["avg_ts"])

