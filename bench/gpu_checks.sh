#!/usr/bin/env bash
# Every check that needs a real CUDA GPU, in one command: the offload parity tests (the same logits and greedy tokens
# with experts in RAM, on the GPU and on the CPU), then bench/gpu_check.py (the real 35B shapes within each preset's
# VRAM cap, with speeds). Arguments go to gpu_check.py. Run from anywhere, with a Python that has the requirements:
#   PYTHON=.venv/bin/python bash bench/gpu_checks.sh --presets 8gb,24gb
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: these checks need a GPU')"
"$PY" -m pytest -q -p no:cacheprovider tests/test_offload.py
"$PY" bench/gpu_check.py "$@"
