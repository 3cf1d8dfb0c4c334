"""``kvroute gate``: the transfer-fidelity gate's checks and verdicts (docs/model-bound-caches.md).

``check`` runs the gate's first check on a pair of local model directories: their tokenizer
fingerprints (``core/gate.tokenizer_verdict``). A mismatch is a failing verdict, recorded in
the store (``--store``, a JSON file) under both sides' fingerprints; identical tokenizers
mean the shadow replay decides (``replay``), so no verdict is recorded and the path stays
closed. ``replay`` evaluates a pair of running engines: tokenizer identity first (a
mismatch ends it before any request), then the shadow replay of transcripts through the
native and candidate paths (``shell/shadow_replay.py``), scored per workload class against
the thresholds of ``--config`` (``core/shadow_replay.py``), with the engines' cache settings
audited before the run and after every turn (a change voids the run: exit code 3, nothing
recorded). ``allows`` asks what a router asks before it uses a path: is there a current,
passing verdict for the pair as the engines run now, measured under the cache settings in
force now (exit code 0), or must it recompute (1)? ``show`` lists the store's verdicts, and with ``--serving`` and ``--source`` says
whether each is current for those directories as they are now.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import typer
import yaml  # type: ignore[import-untyped]  # types-PyYAML is not a dependency
from rich.console import Console

from kvroute.commands.tables import rows_table, wide_console
from kvroute.core.gate import PATHS, PairKey, Verdict, tokenizer_verdict
from kvroute.core.model_identity import ModelIdentity
from kvroute.core.shadow_replay import (
    ClassScore,
    Thresholds,
    TranscriptError,
    TurnComparison,
    parse_thresholds,
    parse_transcripts,
    score_classes,
    verdict_scores,
)
from kvroute.shell.gate_store import GateStoreError, load_store, save_store
from kvroute.shell.model_files import ModelFilesError, read_identity_sync
from kvroute.shell.shadow_replay import (
    Endpoint,
    ReplayError,
    ReplayRun,
    read_policy,
    read_side_identity,
    run_replay,
)

gate_app = typer.Typer(help="The transfer-fidelity gate: checks and verdicts per model pair.",
                       no_args_is_help=True)

_STORE = Path("kvroute-verdicts.json")

# Options the engine-pair commands (replay, allows) share.
_ServingUrl = Annotated[str, typer.Option(
    "--serving", help="Base URL of the serving engine (the native path).")]
_SourceUrl = Annotated[str | None, typer.Option(
    "--source", help="Base URL of the engine whose state would be reused (default: --serving).")]
_ModelName = Annotated[str, typer.Option("--model", help="Served model name on both engines.")]
_PathOption = Annotated[str, typer.Option("--path", help=f"Transfer path: {', '.join(PATHS)}.")]
_ServingDir = Annotated[str | None, typer.Option(
    "--serving-model", help="Model directory of the serving weights (default: its /v1/models root).")]
_SourceDir = Annotated[str | None, typer.Option(
    "--source-model", help="Model directory of the source weights (default: its /v1/models root).")]
_StoreOption = Annotated[Path, typer.Option("--store", help="Verdict file (JSON).")]


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
    path: _PathOption = "cross-engine",
    store: _StoreOption = _STORE,
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
        out.print("tokenizers identical: the shadow replay decides this pair (`kvroute gate "
                  "replay` on engines serving them); no verdict recorded, the path stays "
                  "closed (recompute)")
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
    store: _StoreOption = _STORE,
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


def _thresholds(config: Path | None, console: Console
                ) -> tuple[Thresholds, dict[str, Thresholds], int]:
    """Thresholds (default and per class) and top-k from a gate config file, or defaults."""
    if config is None:
        return Thresholds(), {}, 5
    try:
        doc = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
        gate = doc.get("gate", doc) if isinstance(doc, dict) else None
        if not isinstance(gate, dict):
            raise ValueError(  # noqa: TRY004 - bad file content, not a caller type error
                "the file must hold a mapping (a 'gate:' section)")
        unknown = set(gate) - {"thresholds", "top_k"}
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(sorted(unknown))} under gate; use "
                             "thresholds, top_k")
        default, per_class = parse_thresholds(gate.get("thresholds") or {})
        top_k = gate.get("top_k", 5)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 20:
            raise ValueError(f"gate.top_k must be an integer from 1 to 20, got {top_k!r}")
    except (OSError, yaml.YAMLError, ValueError) as exc:
        console.print(f"error: gate config {config}: {exc}")
        raise typer.Exit(2) from exc
    return default, per_class, top_k


def _transcripts_text(transcripts: Path | None) -> tuple[str, str]:
    if transcripts is None:
        ref = resources.files("kvroute").joinpath("data/gate/transcripts.jsonl")
        return ref.read_text(encoding="utf-8"), "bundled transcripts.jsonl"
    return transcripts.read_text(encoding="utf-8"), str(transcripts)


async def _evaluate(serving: Endpoint, source: Endpoint, path: str, serving_model: str | None,
                    source_model: str | None, transcripts: Any, top_k: int, out: Console,
                    ) -> tuple[ModelIdentity, ModelIdentity, Verdict | None, ReplayRun | None]:
    async with aiohttp.ClientSession() as http:
        a = await read_side_identity(http, serving, serving_model)
        b = await read_side_identity(http, source, source_model)
        out.print(f"serving {serving.url}: version {a.version}, tokenizer {a.tokenizer}")
        out.print(f"source  {source.url}: version {b.version}, tokenizer {b.tokenizer}")
        stopped = tokenizer_verdict(a, b, path, decided_at=time.time())
        if stopped is not None:
            return a, b, stopped, None

        def progress(t: TurnComparison) -> None:
            div = "-" if t.first_divergence is None else str(t.first_divergence)
            out.print(f"  {t.workload:<11} {t.transcript:<26} turn {t.turn + 1}/{t.num_turns}"
                      f"  exact {'yes' if t.exact else 'NO '}  first divergence {div:>3}"
                      f"  max|dlogprob| {t.max_dlogprob:.4f}  cached {t.candidate_cached_tokens}")

        run = await run_replay(http, serving, source, path, transcripts, top_k=top_k,
                               on_turn=progress)
        return a, b, None, run


def _class_rows(classes: list[ClassScore]) -> list[list[str]]:
    rows = [["class", "transcripts", "turns", "exact match", "top-1 agree", "max |dlogprob|",
             "mean |dlogprob|", "earliest divergence", "cached tokens", "verdict"]]
    for c in classes:
        rows.append([c.workload, str(c.transcripts), str(c.turns), f"{c.exact_match:.3f}",
                     f"{c.top1_agreement:.3f}", f"{c.max_dlogprob:.4f}",
                     f"{c.mean_dlogprob:.4f}",
                     "-" if c.earliest_divergence is None else str(c.earliest_divergence),
                     "?" if c.cached_tokens is None else str(c.cached_tokens),
                     "pass" if c.passed else "FAIL"])
    return rows


@gate_app.command("replay")
def gate_replay(
    serving: _ServingUrl,
    source: _SourceUrl = None,
    model: _ModelName = "tiny",
    path: _PathOption = "prefix-cache-hit",
    transcripts: Annotated[Path | None, typer.Option(
        help="Transcript file (JSONL; default: the bundled sample).")] = None,
    config: Annotated[Path | None, typer.Option(
        help="Gate config (YAML: gate.thresholds, gate.top_k).")] = None,
    serving_model: _ServingDir = None,
    source_model: _SourceDir = None,
    store: _StoreOption = _STORE,
    report: Annotated[Path | None, typer.Option(
        help="Write the per-class and per-turn results here (JSON).")] = None,
) -> None:
    """Evaluate a pair of running engines: tokenizer identity, then the shadow replay."""
    console = Console(stderr=True)
    if path not in PATHS:
        console.print(f"error: --path {path!r} is not a transfer path; use one of "
                      f"{', '.join(PATHS)}")
        raise typer.Exit(2)
    default, per_class, top_k = _thresholds(config, console)
    try:
        text, where = _transcripts_text(transcripts)
        items = parse_transcripts(text, where)
        verdicts = load_store(store)
    except (OSError, TranscriptError, GateStoreError) as exc:
        console.print(f"error: {exc}")
        raise typer.Exit(2) from exc
    serving_ep = Endpoint(serving.rstrip("/"), model)
    source_ep = Endpoint((source or serving).rstrip("/"), model)
    out = wide_console()
    try:
        a, b, stopped, run = asyncio.run(_evaluate(serving_ep, source_ep, path, serving_model,
                                                   source_model, items, top_k, out))
    except ReplayError as exc:
        console.print(f"error: {exc}")
        raise typer.Exit(2) from exc
    if stopped is not None:
        verdicts.record(stopped)
        save_store(store, verdicts)
        out.print(f"FAIL ({path}): {stopped.reason}; no request was replayed; recorded in "
                  f"{store}")
        _write_report(report, stopped, [], None)
        raise typer.Exit(1)
    assert run is not None
    if run.void:
        out.print("VOID: the engines' cache settings or weights changed during the run; no "
                  "verdict recorded:\n  " + "\n  ".join(run.void))
        raise typer.Exit(3)
    classes = score_classes(run.turns, default, per_class)
    failed = [c for c in classes if not c.passed]
    passed = not failed
    reason = (f"replay passed: {len(run.turns)} turns in {len(classes)} classes"
              if passed else "replay failed: " + "; ".join(
                  f"{c.workload}: {', '.join(c.failures)}" for c in failed))
    verdict = Verdict(PairKey.of(a, b, path), passed, reason, dict(run.policy),
                      verdict_scores(classes), time.time())
    verdicts.record(verdict)
    save_store(store, verdicts)
    out.print(rows_table(f"{path}: {serving_ep.url} (native) vs {source_ep.url} "
                         f"(candidate), top-{top_k}", _class_rows(classes),
                         left=("class", "verdict")))
    out.print("cache settings: " + ", ".join(f"{k}={v}" for k, v in sorted(run.policy.items())))
    out.print(f"{'PASS' if passed else 'FAIL'} ({path}): {reason}; recorded in {store}")
    _write_report(report, verdict, classes, run)
    if not passed:
        raise typer.Exit(1)


def _write_report(report: Path | None, verdict: Verdict, classes: list[ClassScore],
                  run: ReplayRun | None) -> None:
    if report is None:
        return
    doc = {
        "passed": verdict.passed, "reason": verdict.reason, "path": verdict.key.path,
        "serving_version": verdict.key.serving_version,
        "source_version": verdict.key.source_version,
        "cache_policy": dict(verdict.cache_policy),
        "classes": [{"class": c.workload, "transcripts": c.transcripts, "turns": c.turns,
                     "exact_match": c.exact_match, "top1_agreement": c.top1_agreement,
                     "max_dlogprob": c.max_dlogprob, "mean_dlogprob": c.mean_dlogprob,
                     "earliest_divergence": c.earliest_divergence,
                     "cached_tokens": c.cached_tokens, "passed": c.passed,
                     "failures": list(c.failures)} for c in classes],
        "turns": [{"transcript": t.transcript, "class": t.workload, "turn": t.turn,
                   "exact": t.exact, "first_divergence": t.first_divergence,
                   "compared": t.compared, "top1_agree": t.top1_agree,
                   "max_dlogprob": t.max_dlogprob,
                   "candidate_cached_tokens": t.candidate_cached_tokens}
                  for t in (run.turns if run is not None else ())],
    }
    report.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


@gate_app.command("allows")
def gate_allows(
    serving: _ServingUrl,
    source: _SourceUrl = None,
    model: _ModelName = "tiny",
    path: _PathOption = "prefix-cache-hit",
    serving_model: _ServingDir = None,
    source_model: _SourceDir = None,
    store: _StoreOption = _STORE,
) -> None:
    """May the path be used now? Exit 0 with a current passing verdict, else 1 (recompute)."""
    console = Console(stderr=True)
    if path not in PATHS:
        console.print(f"error: --path {path!r} is not a transfer path; use one of "
                      f"{', '.join(PATHS)}")
        raise typer.Exit(2)
    try:
        verdicts = load_store(store)
    except GateStoreError as exc:
        console.print(f"error: {exc}")
        raise typer.Exit(2) from exc
    serving_ep = Endpoint(serving.rstrip("/"), model)
    source_ep = Endpoint((source or serving).rstrip("/"), model)

    async def now() -> tuple[ModelIdentity, ModelIdentity, dict[str, str]]:
        async with aiohttp.ClientSession() as http:
            return (await read_side_identity(http, serving_ep, serving_model),
                    await read_side_identity(http, source_ep, source_model),
                    await read_policy(http, {"serving": serving_ep, "source": source_ep}))

    try:
        a, b, policy = asyncio.run(now())
    except ReplayError as exc:
        console.print(f"error: {exc}")
        raise typer.Exit(2) from exc
    allowed, why = verdicts.decide(a, b, path, policy)
    wide_console().print(f"{path} {a.version} <- {b.version}: {why}")
    if not allowed:
        raise typer.Exit(1)
