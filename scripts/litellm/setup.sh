#!/usr/bin/env bash
# Install a real LiteLLM proxy (PyPI `litellm[proxy]`, pinned) for the gateway tests in
# tests/integration/test_litellm_gateway.py. Idempotent and quick (well under a second) when the
# cached venv's stamp matches the pin; the full import check of the proxy (about 10 s) runs only
# right after an install.
#
#   bash scripts/litellm/setup.sh          # prints where things are
#
# Layout, under ${KVROUTE_CACHE:-$HOME/.cache/kvroute}/litellm:
#   venv/                the venv; .kvroute-stamp holds the pinned version
#   unavailable.txt      written (and exit 0) when setup cannot complete: tests/gateway.py reads
#                        it and the LiteLLM tests skip with its text as the reason. Removed on
#                        success.
#   setup.log            pip's output of the last install
#
# The pin is the version the project's gateway research was verified against (LiteLLM 1.108.7;
# KVROUTE_LITELLM_VERSION overrides it for trying a newer one); the install is about 120 packages / 0.75 GB and takes
# one to three minutes the first time. LiteLLM is kept out of the project venv on purpose: its
# proxy extra pins fastapi/uvicorn/pydantic versions that must not constrain kvroute's.
#
# Exit status is 0 both when ready and when the install is impossible here (so CI keeps going
# and the tests skip); only misuse of the script itself exits non-zero.
set -uo pipefail

LITELLM_VERSION="${KVROUTE_LITELLM_VERSION:-1.108.7}"
CACHE="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
ROOT="$CACHE/litellm"
VENV="$ROOT/venv"
MARKER="$ROOT/unavailable.txt"
LOG="$ROOT/setup.log"
PY="${KVROUTE_LITELLM_BASE_PYTHON:-python3}"

STAMP_WANT="litellm[proxy]==$LITELLM_VERSION"

mkdir -p "$ROOT" || { echo "litellm: cannot create $ROOT" >&2; exit 0; }

unavailable() {
    # Record why, print it, and exit 0 so that callers (.ci/run) carry on and tests skip.
    local reason="$1"
    {
        echo "LiteLLM proxy unavailable: $reason"
        echo "(setup log: $LOG; retry with: bash scripts/litellm/setup.sh)"
    } >"$MARKER"
    echo "litellm: UNAVAILABLE: $reason" >&2
    echo "litellm: marker written to $MARKER; LiteLLM gateway tests will skip" >&2
    exit 0
}

# One setup at a time (several engineers/CI jobs may share the cache).
exec 9>"$ROOT/.setup.lock"
if command -v flock >/dev/null 2>&1; then
    flock -w 900 9 || unavailable "another setup.sh held $ROOT/.setup.lock for 15 min"
fi

ready_check() {
    # The proxy's console script exists and its server module imports offline (the local cost
    # map keeps the import from fetching anything).
    [[ -x "$VENV/bin/litellm" ]] && LITELLM_LOCAL_MODEL_COST_MAP=True \
        "$VENV/bin/python" -c 'import litellm.proxy.proxy_server' >/dev/null 2>&1
}

quick_check() {
    [[ -x "$VENV/bin/litellm" && -x "$VENV/bin/python" ]]
}

# ---- fast path --------------------------------------------------------------------------------
if [[ -f "$VENV/.kvroute-stamp" && "$(cat "$VENV/.kvroute-stamp")" == "$STAMP_WANT" ]] && quick_check; then
    rm -f "$MARKER"
    echo "litellm: ready (cached)"
    echo "litellm: venv $VENV"
    exit 0
fi

: >"$LOG"
command -v "$PY" >/dev/null 2>&1 || unavailable "no '$PY' to build the venv with (set KVROUTE_LITELLM_BASE_PYTHON)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 9))' 2>/dev/null \
    || unavailable "LiteLLM needs Python >= 3.9 (tried '$PY'; set KVROUTE_LITELLM_BASE_PYTHON)"

echo "litellm: installing litellm[proxy]==$LITELLM_VERSION into $VENV (1-3 min, ~0.75 GB; log: $LOG)"
rm -rf "$VENV"
start=$SECONDS
"$PY" -m venv "$VENV" >>"$LOG" 2>&1 || unavailable "python -m venv $VENV failed"
"$VENV/bin/pip" install -q --upgrade pip >>"$LOG" 2>&1 || unavailable "pip upgrade failed"
if ! "$VENV/bin/pip" install "litellm[proxy]==$LITELLM_VERSION" >>"$LOG" 2>&1; then
    unavailable "pip install litellm[proxy]==$LITELLM_VERSION failed: $(grep -E '^ERROR' "$LOG" | tail -2 | tr '\n' ' ')"
fi
got="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))' 2>>"$LOG")" \
    || unavailable "litellm installed but its metadata cannot be read (see $LOG)"
[[ "$got" == "$LITELLM_VERSION" ]] || unavailable "unexpected litellm version after install: '$got' (want '$LITELLM_VERSION')"
ready_check || unavailable "litellm installed but 'import litellm.proxy.proxy_server' fails (see $LOG)"
echo "$STAMP_WANT" >"$VENV/.kvroute-stamp"
rm -f "$MARKER"
echo "litellm: ready in $((SECONDS - start)) s"
echo "litellm: venv $VENV"
exit 0
