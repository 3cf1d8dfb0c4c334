#!/usr/bin/env bash
# Install the two PyPI-installable peer routers for `kvroute bench live` and its integration
# test: sglang-router (Rust, Python launcher) and vllm-router (Rust binary), pinned to the
# versions measured in docs/peer-fidelity.md. Idempotent and quick (a second) when the cached
# venv's stamp matches the pins.
#
#   bash scripts/peer_routers/setup.sh          # prints where things are
#
# Layout, under ${KVROUTE_CACHE:-$HOME/.cache/kvroute}/peer-routers:
#   venv/                the venv; .kvroute-stamp holds the pinned versions
#   unavailable.txt      written (and exit 0) when setup cannot complete: the tests and
#                        `kvroute bench live` read it and skip the peers with its text as the
#                        reason. Removed on success.
#   setup.log            pip's output of the last install
#
# Exit status is 0 both when ready and when the install is impossible here (so CI keeps going
# and the tests skip); only misuse of the script itself exits non-zero.
set -uo pipefail

SGLANG_ROUTER_VERSION="0.3.2"
VLLM_ROUTER_VERSION="0.1.17"
CACHE="${KVROUTE_CACHE:-$HOME/.cache/kvroute}"
ROOT="$CACHE/peer-routers"
VENV="$ROOT/venv"
MARKER="$ROOT/unavailable.txt"
LOG="$ROOT/setup.log"
PY="${KVROUTE_PEER_BASE_PYTHON:-python3}"

STAMP_WANT="sglang-router==$SGLANG_ROUTER_VERSION vllm-router==$VLLM_ROUTER_VERSION"

mkdir -p "$ROOT" || { echo "peer-routers: cannot create $ROOT" >&2; exit 0; }

unavailable() {
    # Record why, print it, and exit 0 so that callers (.ci/run) carry on and tests skip.
    local reason="$1"
    {
        echo "peer routers unavailable: $reason"
        echo "(setup log: $LOG; retry with: bash scripts/peer_routers/setup.sh)"
    } >"$MARKER"
    echo "peer-routers: UNAVAILABLE: $reason" >&2
    echo "peer-routers: marker written to $MARKER; peer-router runs will be skipped" >&2
    exit 0
}

# One setup at a time (several engineers/CI jobs may share the cache).
exec 9>"$ROOT/.setup.lock"
if command -v flock >/dev/null 2>&1; then
    flock -w 600 9 || unavailable "another setup.sh held $ROOT/.setup.lock for 10 min"
fi

ready_check() {
    # Both entry points exist and the launcher module imports.
    [[ -x "$VENV/bin/vllm-router" ]] && "$VENV/bin/python" -c 'import sglang_router.launch_router' \
        >/dev/null 2>&1
}

# ---- fast path --------------------------------------------------------------------------------
if [[ -f "$VENV/.kvroute-stamp" && "$(cat "$VENV/.kvroute-stamp")" == "$STAMP_WANT" ]] && ready_check; then
    rm -f "$MARKER"
    echo "peer-routers: ready (cached)"
    echo "peer-routers: venv $VENV"
    exit 0
fi

: >"$LOG"
echo "peer-routers: installing $STAMP_WANT into $VENV (log: $LOG)"
[[ "$(uname -s)" == "Linux" ]] \
    || unavailable "the pinned wheels are installed on Linux only here (this is $(uname -s))"
command -v "$PY" >/dev/null 2>&1 || unavailable "no '$PY' interpreter (set KVROUTE_PEER_BASE_PYTHON)"

rm -rf "$VENV"
start=$SECONDS
"$PY" -m venv "$VENV" >>"$LOG" 2>&1 || unavailable "$PY -m venv $VENV failed"
"$VENV/bin/pip" install -q --upgrade pip >>"$LOG" 2>&1 || unavailable "pip upgrade failed (offline?)"
if ! "$VENV/bin/pip" install --only-binary=:all: \
        "sglang-router==$SGLANG_ROUTER_VERSION" "vllm-router==$VLLM_ROUTER_VERSION" >>"$LOG" 2>&1; then
    unavailable "pip install $STAMP_WANT failed: $(grep -E '^ERROR' "$LOG" | tail -2 | tr '\n' ' ')"
fi
ready_check || unavailable "installed, but vllm-router or sglang_router.launch_router is missing (see $LOG)"
echo "$STAMP_WANT" >"$VENV/.kvroute-stamp"
rm -f "$MARKER"
echo "peer-routers: ready in $((SECONDS - start)) s"
echo "peer-routers: venv $VENV"
exit 0
