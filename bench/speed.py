"""Decode and prefill speed, peak memory and the memory roofline: our engine vs transformers vs llama.cpp.

    nice -n 10 python bench/speed.py                 # everything (about an hour on 2 cores)
    python bench/speed.py --no-llama --no-transformers --quick
    python bench/speed.py --profile --ours bf16      # torch.profiler's top ops of our decode
    python bench/speed.py --no-llama --no-transformers --ours bf16,bf16+int8 --baseline HEAD~3   # a change's cost
    python bench/speed.py --no-llama --no-transformers --ours bf16 --vl   # Qwen3-VL-MoE vs Qwen3.5 per parameter
    python bench/speed.py --no-llama --ours bf16+int8,bf16+int8+dense8,bf16+int4+dense4   # dense int8 / int4
    python bench/speed.py --no-transformers --no-image --ours gguf-q4_k_m,gguf-q8_0 --llama-types q4_k_m,q8_0

An --ours configuration is `compute[+experts][+denseN][+loraR]`: the compute dtype (fp32, bf16), the routed experts'
format (fp32, bf16, fp8, int8, int4; default: the compute dtype), with +dense8 / +dense4 the dense matrices held as int8
/ int4 (load option dense_format; default: the compute dtype), and with +loraR a rank-R LoRA adapter on every
projection (attention, DeltaNet, shared expert; worker.py writes it).

All systems run the same random-weight checkpoint (bench_model.py: Qwen3.5-MoE text, 1.8 B parameters, 64 experts
top-8) on the same thread count, each measurement in its own process (so peak RSS is that system's), in rounds that
interleave the systems (A, B, C, A, B, C, ...) so that the machine's speed swings hit all of them alike. Reported:
medians over the rounds, the largest peak RSS, and ratios between every system of ours and every other system.
Decode: `--decode` greedy tokens at batch 1 from a 1-token prompt; prefill: one `--prefill`-token prompt; llama.cpp
runs llama-bench's pp/tg tests with the same sizes. Roofline: the weight bytes a decoded token reads divided by the
memory bandwidth measured here (1 GiB fp32 sum, best of every round); '% roofline' is decode / that bound.
With --vl, our engine also runs each configuration on the Qwen3-VL-MoE bench model (same size class, every layer
full attention, no shared expert) in the same rounds, and the report compares the two families per active parameter:
tok/s x the parameters a token reads (roofline.active_params: the embedding table excluded, the LM head included).
Outputs (checkpoint, GGUF files, llama.cpp build, converted experts, results JSON) go to $A3B_BENCH_DIR
(default ~/.cache/a3b-bench).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: bench.*, a3b_core

from bench import llama  # noqa: E402
from bench.bench_model import FAMILIES, bench_dir, checkpoint_folder, text_config  # noqa: E402
from bench.machine import cpu_description  # noqa: E402
from bench.roofline import gguf_bytes_per_token  # noqa: E402

DEMO_MODEL = HERE.parent / "a3b_core" / "demo" / "a3b-demo" / "config.json"
COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DEFAULT_OURS = "fp32,bf16,bf16+fp8,bf16+int8,bf16+int4"
SETTINGS = ("threads", "rounds", "prefill", "decode")  # what a saved results file needs for its report
GB = 1e9
VL_MARK = " vl "  # in a system's name: our engine on the Qwen3-VL-MoE bench model ("ours vl bf16")
PER_PARAMETER_TOLERANCE = 0.10  # Qwen3-VL-MoE may be at most this much slower per active parameter than Qwen3.5


@dataclass
class System:
    name: str
    command: list[str]
    parse: object  # stdout -> dict of measurements
    weight_bytes_per_token: int | None = None
    runs: list[dict] = field(default_factory=list)

    def peak_rss(self) -> int:
        return max(r["peak_rss_bytes"] for r in self.runs)

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if r.get(key) is not None]
        return statistics.median(values) if values else None


def worker_result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError("the worker printed no RESULT line")
    return json.loads(lines[-1][len("RESULT "):])


def run_child(command: list[str], env: dict) -> tuple[str, int]:
    """Runs one measurement process; returns its stdout and its own peak RSS in bytes, from wait4 (so tools that
    cannot report it, like llama-bench, are measured the same way; Popen.wait would discard it)."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        if process.returncode != 0:
            hint = " (SIGILL: an instruction this CPU refuses; for llama-bench, try --llama-no-amx)" \
                if process.returncode == -signal.SIGILL else ""
            raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}){hint}:\n{stderr.read()[-3000:]}")
        return stdout.read(), usage.ru_maxrss * 1024  # Linux reports KiB


DENSE_SPECS = {"dense8": "int8", "dense4": "int4"}  # an --ours suffix -> the load option dense_format


def ours_spec(spec: str) -> tuple[str, str, str, int]:
    """'bf16+int4' -> (compute dtype, routed-expert format, dense format, LoRA rank); 'fp32' -> ('float32', 'fp32',
    'auto', 0); 'bf16+int8+dense8+lora16' -> ('bfloat16', 'int8', 'int8', 16). fp8 means the checkpoint's own FP8
    experts (the FP8-layout copy of the bench model)."""
    compute, *rest = spec.split("+")
    lora = int(rest.pop()[4:]) if rest and rest[-1].startswith("lora") and rest[-1][4:].isdigit() else 0
    dense = DENSE_SPECS[rest.pop()] if rest and rest[-1] in DENSE_SPECS else "auto"
    experts = rest[0] if len(rest) == 1 else ""
    if compute not in COMPUTE_DTYPES or len(rest) > 1 or experts not in ("", "fp32", "bf16", "fp8", "int8", "int4"):
        raise SystemExit(f"--ours {spec!r}: expected a compute dtype ({', '.join(COMPUTE_DTYPES)}), optionally "
                         "followed by +fp8, +int8, +int4, +bf16 or +fp32 for the routed experts and by +dense8 or "
                         "+dense4 for the dense matrices and by +loraR for a rank-R adapter (e.g. bf16+int4, "
                         "bf16+int8+dense8, bf16+lora16).")
    return COMPUTE_DTYPES[compute], experts or compute, dense, lora


GGUF_SPEC = "gguf-"  # --ours gguf-q4_k_m: our engine on llama.cpp's own file of that type (bf16 compute)


def ours_command(args, spec: str, mode: str, *options: str, tree: Path = HERE.parent,
                 family: str = FAMILIES[0]) -> list[str]:
    if spec.startswith(GGUF_SPEC):  # the file llama-bench runs: its experts kept in their blocks (auto)
        kind = spec[len(GGUF_SPEC):]
        llama_tree = llama.llama_tree(args.llama_cpp, args.build_jobs, args.llama_no_amx)
        path = llama.gguf_files(llama_tree, checkpoint_folder(args.small, family=family), [kind], args.threads)[kind]
        return worker(args.threads, mode, "--model", str(path), "--dtype", "bfloat16", "--format", "auto", *options,
                      tree=tree)
    dtype, experts, dense, lora = ours_spec(spec)
    model_dir = checkpoint_folder(args.small, fp8=experts == "fp8", family=family)
    # given only when asked: a --baseline engine older than an option runs the other configurations unchanged
    dense_option = ("--dense-format", dense) if dense != "auto" else ()
    lora_option = ("--lora-rank", str(lora)) if lora else ()
    return worker(args.threads, mode, "--model", str(model_dir), "--dtype", dtype, "--format", experts,
                  *dense_option, *lora_option, *options, tree=tree)


def worker(threads: int, *args: str, tree: Path = HERE.parent) -> list[str]:
    return [sys.executable, str(tree / "bench" / "worker.py"), *args, "--threads", str(threads)]


def engine_tree(revision: str) -> Path:
    """The repository at `revision`, exported once into the bench cache, so its engine runs beside this one."""
    sha = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--verify", f"{revision}^{{commit}}"],
                         capture_output=True, text=True).stdout.strip()
    if not sha:
        raise SystemExit(f"--baseline {revision!r} is not a commit of this repository; give a commit or branch.")
    tree = bench_dir() / "engines" / sha[:12]
    if not (tree / "bench" / "worker.py").is_file():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", sha], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def vl_runs(args, spec: str) -> bool:
    """Whether --vl runs this configuration on the Qwen3-VL-MoE bench model too (which has no FP8 copy)."""
    if spec.startswith(GGUF_SPEC):
        return args.vl
    if args.vl and ours_spec(spec)[1] == "fp8":
        print(f"[bench] --vl: ours {spec} runs on Qwen3.5 only (the Qwen3-VL-MoE bench model has no FP8 copy)")
    return args.vl and ours_spec(spec)[1] != "fp8"


def build_systems(args, model_dir: Path) -> list[System]:
    sizes = ["--prefill", str(args.prefill), "--decode", str(args.decode)]
    systems = []
    baselines = {revision: engine_tree(revision) for revision in args.baseline.split(",") if revision}
    for spec in args.ours.split(","):
        for mark, family in [("", FAMILIES[0])] + ([(VL_MARK.lstrip(), FAMILIES[1])] if vl_runs(args, spec) else []):
            systems.append(System(f"ours {mark}{spec}", ours_command(args, spec, "ours", *sizes, family=family),
                                  worker_result))
            for revision, tree in baselines.items():  # the same configuration, run by another commit's engine
                systems.append(System(f"ours@{revision} {mark}{spec}",
                                      ours_command(args, spec, "ours", *sizes, tree=tree, family=family),
                                      worker_result))
    if not args.no_transformers:
        for name in ("fp32", "bf16"):
            command = worker(args.threads, "transformers", "--model", str(model_dir), "--dtype",
                             COMPUTE_DTYPES[name], *sizes)
            systems.append(System(f"transformers {name}", command, worker_result))
    if not args.no_llama:
        tree = llama.llama_tree(args.llama_cpp, args.build_jobs, args.llama_no_amx)
        cfg = text_config(args.small)
        for kind, path in llama.gguf_files(tree, model_dir, args.llama_types.split(","), args.threads).items():
            per_token = gguf_bytes_per_token(llama.gguf_tensor_bytes(tree, path), cfg["num_experts_per_tok"],
                                             cfg["num_experts"], cfg["vocab_size"])
            systems.append(System(f"llama.cpp {kind.upper()}", llama.bench_command(
                tree, path, args.prefill, args.decode, args.threads), llama.parse_bench, per_token))
    if args.no_image:
        print("[bench] image and video TTFT skipped (--no-image)")
    elif DEMO_MODEL.is_file():
        command = worker(args.threads, "image-ttft", "--dtype", "float32")
        systems.append(System("ours image TTFT (demo, fp32)", command, worker_result))
        command = worker(args.threads, "video-ttft", "--dtype", "float32")
        systems.append(System("ours video TTFT (demo, fp32)", command, worker_result))
    else:
        print(f"[bench] image and video TTFT skipped: the demo model {DEMO_MODEL.parent} does not exist yet")
    return systems


def run_rounds(systems: list[System], rounds: int, threads: int, env: dict, bandwidths: list[float],
               save: Callable[[], None]) -> None:
    """Fills `bandwidths` and each system's runs, calling `save` after every measurement; measurements already
    there (a resumed run) are kept."""
    for round_number in range(1, rounds + 1):
        if len(bandwidths) < round_number:
            bandwidths.append(worker_result(run_child(worker(threads, "bandwidth"), env)[0])["bandwidth_bytes_s"])
        print(f"[bench] round {round_number}/{rounds}: bandwidth {bandwidths[round_number - 1] / GB:.1f} GB/s",
              flush=True)
        for system in systems:
            if len(system.runs) >= round_number:
                continue
            started = time.perf_counter()
            stdout, peak = run_child(system.command, env)
            result = system.parse(stdout) | {"peak_rss_bytes": peak}
            system.runs.append(result)
            if system.weight_bytes_per_token is None:
                system.weight_bytes_per_token = result.get("weight_bytes_per_token")
            shown = {k: round(v, 3) for k, v in result.items() if isinstance(v, float)}
            print(f"[bench]   {system.name}: {shown} peak {peak / GB:.2f} GB ({time.perf_counter() - started:.0f} s)",
                  flush=True)
            save()


# ------------------------------------------------------------------------------------------------- the report
def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def engine_version() -> str:
    """The commit our engine ran from, marked when the working tree differs from it."""
    def git(*command: str) -> str:
        return subprocess.run(["git", "-C", str(HERE.parent), *command], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "a3b_core")
    return f"{git('rev-parse', '--short', 'HEAD') or 'unknown'}{' + uncommitted a3b_core changes' if dirty else ''}"


def report(systems: list[System], bandwidths: list[float], heading: str, args) -> str:
    timed = [s for s in systems if s.median("decode_tok_s") is not None]
    bandwidth = max(bandwidths)  # the roofline is a bound: the best the memory was seen to do
    lines = [f"{heading}; threads {args.threads}, {args.rounds} rounds (medians; peak RSS: the largest), prefill "
             f"{args.prefill} tokens, decode {args.decode} tokens at batch 1 greedy; memory bandwidth (1 GiB fp32 "
             f"read, once per round) best {bandwidth / GB:.1f} GB/s, median {statistics.median(bandwidths) / GB:.1f}, "
             f"worst {min(bandwidths) / GB:.1f}; the roofline uses the best", "",
             "| system | decode tok/s | prefill tok/s | prefill time s | peak RSS GB | load s | weight GB/token "
             "| roofline tok/s | % of roofline |", "|---|---|---|---|---|---|---|---|---|"]
    for s in timed:
        decode, prefill, per_token = s.median("decode_tok_s"), s.median("prefill_tok_s"), s.weight_bytes_per_token
        roof = bandwidth / per_token if per_token else None
        lines.append(f"| {s.name} | {fmt(decode)} | {fmt(prefill, 1)} | {fmt(args.prefill / prefill)} "
                     f"| {fmt(s.peak_rss() / GB)} | {fmt(s.median('load_s'), 1)} "
                     f"| {fmt(per_token / GB if per_token else None, 3)} | {fmt(roof, 1)} "
                     f"| {fmt(100 * decode / roof if roof else None, 0)}% |")
    for s in systems:
        if s.median("image_ttft_s") is not None:
            lines += ["", f"{s.name}: time to first token {s.median('image_ttft_s'):.2f} s for one 384x384 image "
                          f"({s.runs[0]['image_tokens']} image tokens) + {s.runs[0]['text_tokens']} text tokens, "
                          f"peak RSS {s.peak_rss() / GB:.2f} GB"]
        if s.median("video_ttft_s") is not None:
            lines += ["", f"{s.name}: time to first token {s.median('video_ttft_s'):.2f} s for a "
                          f"{s.runs[0]['frames']}-frame 384x384 clip ({s.runs[0]['video_tokens']} video tokens) + "
                          f"{s.runs[0]['text_tokens']} text tokens, peak RSS {s.peak_rss() / GB:.2f} GB"]
    ratios = (("decode speed", lambda s: s.median("decode_tok_s"), "faster"),
              ("prefill speed", lambda s: s.median("prefill_tok_s"), "faster"),
              ("peak RSS", System.peak_rss, "larger"))
    for title, value, more in ratios:
        lines += ["", f"{title}, row / column (>1: the row is {more}):", "",
                  "| row \\ column | " + " | ".join(o.name for o in timed) + " |", "|---|" + "---|" * len(timed)]
        for s in timed:
            if s.name.startswith("ours"):
                lines.append(f"| {s.name} | " + " | ".join(fmt(value(s) / value(o)) for o in timed) + " |")
    return "\n".join(lines + per_parameter_report(timed))


def per_parameter_report(timed: list[System]) -> list[str]:
    """Each of our systems on the Qwen3-VL-MoE bench model against the same configuration on the Qwen3.5 one, per
    active parameter: (tok/s x active parameters) of VL / the same of Qwen3.5, for decode and prefill."""
    by_name = {s.name: s for s in timed}
    pairs = [(s, by_name[s.name.replace(VL_MARK, " ", 1)]) for s in timed
             if VL_MARK in s.name and s.name.replace(VL_MARK, " ", 1) in by_name]
    # an engine from before active_params was reported (a --baseline commit) cannot be compared this way
    pairs = [(vl, qwen35) for vl, qwen35 in pairs if all("active_params" in s.runs[0] for s in (vl, qwen35))]
    if not pairs:
        return []
    lines = ["", "per active parameter, Qwen3-VL-MoE / Qwen3.5-MoE (tok/s x active parameters; active: the embedding "
                 "table excluded, the LM head included); required: both ratios at least "
                 f"{1 - PER_PARAMETER_TOLERANCE:.2f}",
             "", "| Qwen3-VL-MoE | Qwen3.5-MoE | active params VL / 3.5 | decode tok/s VL / 3.5 "
                 "| prefill tok/s VL / 3.5 | decode per param | prefill per param | met |",
             "|---|---|---|---|---|---|---|---|"]
    for vl, qwen35 in pairs:
        active_vl, active_35 = vl.runs[0]["active_params"], qwen35.runs[0]["active_params"]
        ratios = [vl.median(key) * active_vl / (qwen35.median(key) * active_35)
                  for key in ("decode_tok_s", "prefill_tok_s")]
        met = "yes" if min(ratios) >= 1 - PER_PARAMETER_TOLERANCE else "NO"
        lines.append(f"| {vl.name} | {qwen35.name} | {active_vl / GB:.3f} B / {active_35 / GB:.3f} B "
                     f"| {fmt(vl.median('decode_tok_s'))} / {fmt(qwen35.median('decode_tok_s'))} "
                     f"| {fmt(vl.median('prefill_tok_s'), 1)} / {fmt(qwen35.median('prefill_tok_s'), 1)} "
                     f"| {fmt(ratios[0])} | {fmt(ratios[1])} | {met} |")
    return lines


def profile(args, env: dict) -> None:
    for spec in args.ours.split(","):
        for family in FAMILIES if vl_runs(args, spec) else FAMILIES[:1]:
            subprocess.run(ours_command(args, spec, "profile", "--decode", str(args.profile_steps), "--top",
                                        str(args.top), family=family), check=True, env=env)


def measured_sizes(quick: bool, prefill: int | None, decode: int | None) -> tuple[int, int]:
    """The prefill test's prompt tokens and the decode test's new tokens: as given, else --quick's or the defaults."""
    default_prefill, default_decode = (128, 32) if quick else (512, 128)
    return prefill or default_prefill, decode or default_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians need 3 or more")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a 128-token prompt and 32 new tokens")
    parser.add_argument("--prefill", type=int, help="prompt tokens of the prefill test (default 512; --quick: 128)")
    parser.add_argument("--decode", type=int, help="greedy tokens of the decode test (default 128; --quick: 32)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp (and its build)")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers")
    parser.add_argument("--no-image", action="store_true", help="skip the demo model's image and video TTFT")
    parser.add_argument("--ours", default=DEFAULT_OURS,
                        help=f"our configurations, COMPUTE[+EXPERTS] comma-separated (default {DEFAULT_OURS}); "
                             "gguf-TYPE (e.g. gguf-q4_k_m) runs llama.cpp's own GGUF file of that type")
    parser.add_argument("--vl", action="store_true",
                        help="run each --ours configuration on the Qwen3-VL-MoE bench model too, in the same rounds, "
                             "and compare the two families per active parameter")
    parser.add_argument("--baseline", default="",
                        help="commits (comma-separated) whose engine runs each --ours configuration too, in the same "
                             "rounds, e.g. to compare a change with the commit before it")
    parser.add_argument("--llama-types", default="bf16,q8_0,q4_k_m",
                        help="GGUF types for llama.cpp (bf16, q8_0, q4_k_m, q4_0, f32: any llama-quantize takes)")
    parser.add_argument("--llama-cpp", type=Path, default=os.environ.get("A3B_LLAMA_CPP"),
                        help="an already built llama.cpp tree (build/bin/llama-bench); default $A3B_LLAMA_CPP, else "
                             "the bench cache's own build")
    parser.add_argument("--llama-no-amx", action="store_true",
                        help="build (once) and run a llama.cpp without AMX instructions: for machines that report AMX "
                             "but refuse it, where llama-bench dies with SIGILL (exit -4)")
    parser.add_argument("--build-jobs", type=int, default=2, help="parallel jobs for the llama.cpp build")
    parser.add_argument("--small", action="store_true",
                        help="a 4-layer stand-in model: checks the bench end to end in minutes (numbers meaningless)")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of our decode instead")
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=25, help="profile: rows per table")
    parser.add_argument("--report", type=Path, help="print the report of a saved results file and exit")
    parser.add_argument("--resume", type=Path, help="continue an interrupted run from its results file")
    args = parser.parse_args()
    args.prefill, args.decode = measured_sizes(args.quick, args.prefill, args.decode)
    if args.llama_cpp is not None:
        args.llama_cpp = Path(args.llama_cpp).expanduser().resolve()

    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "A3B_KEEP_HEAP": "1",
                        "A3B_CACHE_DIR": os.environ.get("A3B_CACHE_DIR", str(bench_dir() / "a3b-cache"))}
    if args.profile:
        profile(args, env)
        return
    if args.report is not None:
        print(saved_report(args.report))
        return
    model_dir = checkpoint_folder(args.small)
    if args.rounds < 3:
        print("[bench] note: fewer than 3 rounds; the medians are not the reported kind")
    heading = f"model {model_dir.name}, engine {engine_version()} at the start, {cpu_description()}"
    systems = build_systems(args, model_dir)
    out = bench_dir() / f"speed-{time.strftime('%Y%m%d-%H%M%S')}.json"
    bandwidths: list[float] = []
    if args.resume is not None:  # same settings assumed: the saved runs count as this run's first rounds
        out, saved = args.resume, json.loads(args.resume.read_text())
        heading, bandwidths = saved["heading"] + " (resumed)", saved["bandwidths"]
        runs = {s["name"]: s["runs"] for s in saved["systems"]}
        for system in systems:
            system.runs = runs.get(system.name, [])
            system.weight_bytes_per_token = system.weight_bytes_per_token or next(
                (r["weight_bytes_per_token"] for r in system.runs if "weight_bytes_per_token" in r), None)
    print(f"[bench] raw results, saved after every measurement (--report FILE reprints them, --resume FILE "
          f"continues them): {out}", flush=True)

    def save() -> None:
        out.write_text(json.dumps({"heading": heading, "settings": {k: getattr(args, k) for k in SETTINGS},
                                   "bandwidths": bandwidths,
                                   "systems": [{"name": s.name, "weight_bytes_per_token": s.weight_bytes_per_token,
                                                "runs": s.runs} for s in systems]}, indent=1))

    run_rounds(systems, args.rounds, args.threads, env, bandwidths, save)
    print("\n" + report(systems, bandwidths, heading, args))


def saved_report(path: Path) -> str:
    """The report of a saved results file, also of a run that stopped early (medians of the rounds it finished)."""
    saved = json.loads(path.read_text())
    systems = [System(s["name"], [], None, s["weight_bytes_per_token"], s["runs"]) for s in saved["systems"]]
    settings = argparse.Namespace(**saved["settings"])
    settings.rounds = min(len(s.runs) for s in systems if s.runs)
    return report([s for s in systems if s.runs], saved["bandwidths"], saved["heading"], settings)


if __name__ == "__main__":
    main()
