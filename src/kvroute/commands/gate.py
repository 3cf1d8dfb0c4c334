"""``kvroute gate``: the transfer-fidelity gate's checks and verdicts (docs/model-bound-caches.md).

``check`` runs the gate's first check on a pair of local model directories: their tokenizer
fingerprints (``core/gate.tokenizer_verdict``). A mismatch is a failing verdict, recorded in
the store (``--store``, a JSON file) under both sides' fingerprints; identical tokenizers
mean the shadow replay decides, which is not built yet, so no verdict is recorded and the
path stays closed. ``show`` lists the store's verdicts, and with ``--serving`` and
``--source`` says whether each is current for those directories as they are now.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvroute.commands.tables import rows_table, wide_console
from kvroute.core.gate import PATHS, tokenizer_verdict
from kvroute.core.model_identity import ModelIdentity
from kvroute.shell.gate_store import GateStoreError, load_store, save_store
from kvroute.shell.model_files import ModelFilesError, read_identity_sync

gate_app = typer.Typer(help="The transfer-fidelity gate: checks and verdicts per model pair.",
                       no_args_is_help=True)

_STORE = Path("kvroute-verdicts.json")


def _identity(directory: Path, what: str, console: Console) -> ModelIdentity:
    if not directory.is_dir():
        console.print(f"error: {what} {directory} is not a directory; pass a local model "
                      "directory (config.json, weights, tokenizer.json)")
        raise typer.Exit(2)
    try:
        return read_identity_sync(directory.name, str(directory))
    except ModelFilesError as exc:
        console.print(f"error: {exc}")
        raise typer.Exit(2) from exc


@gate_app.command("check")
def gate_check(
    serving: Annotated[Path, typer.Argument(help="Model directory of the serving weights.")],
    source: Annotated[Path, typer.Argument(help="Model directory whose state would be reused.")],
    path: Annotated[str, typer.Option(help=f"Transfer path: {', '.join(PATHS)}.")] = "cross-engine",
    store: Annotated[Path, typer.Option(help="Verdict file (JSON).")] = _STORE,
) -> None:
    """Tokenizer identity of a pair; a mismatch is recorded as a failing verdict."""
    console = Console(stderr=True)
    if path not in PATHS:
        console.print(f"error: --path {path!r} is not a transfer path; use one of "
                      f"{', '.join(PATHS)}")
        raise typer.Exit(2)
    a, b = _identity(serving, "serving", console), _identity(source, "source", console)
    out = wide_console()
    out.print(f"serving {serving}: version {a.version}, tokenizer {a.tokenizer}")
    out.print(f"source  {source}: version {b.version}, tokenizer {b.tokenizer}")
    verdict = tokenizer_verdict(a, b, path, decided_at=time.time())
    if verdict is None:
        out.print("tokenizers identical: the shadow replay decides this pair, and it is not "
                  "built yet; no verdict recorded, the path stays closed (recompute)")
        return
    try:
        verdicts = load_store(store)
    except GateStoreError as exc:
        console.print(f"error: {exc}")
        raise typer.Exit(2) from exc
    verdicts.record(verdict)
    save_store(store, verdicts)
    out.print(f"FAIL ({path}): {verdict.reason}; recorded in {store}")
    raise typer.Exit(1)


@gate_app.command("show")
def gate_show(
    store: Annotated[Path, typer.Option(help="Verdict file (JSON).")] = _STORE,
    serving: Annotated[Path | None, typer.Option(help="Serving model directory now.")] = None,
    source: Annotated[Path | None, typer.Option(help="Source model directory now.")] = None,
) -> None:
    """The store's verdicts; with --serving and --source, whether each is current."""
    console = Console(stderr=True)
    try:
        verdicts = load_store(store)
    except GateStoreError as exc:
        console.print(f"error: {exc}")
        raise typer.Exit(2) from exc
    now = None
    if serving is not None and source is not None:
        now = (_identity(serving, "serving", console), _identity(source, "source", console))
    rows = [["serving", "source", "path", "verdict", "current", "reason"]]
    for v in verdicts:
        current = "-"
        if now is not None:
            found = verdicts.current(now[0], now[1], v.key.path)
            current = "yes" if found == v else "stale"
        rows.append([v.key.serving_version, v.key.source_version, v.key.path,
                     "pass" if v.passed else "FAIL", current, v.reason])
    wide_console().print(rows_table(f"verdicts in {store}", rows,
                                    left=("serving", "source", "path", "reason")))
