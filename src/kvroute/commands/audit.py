"""``kvroute audit``: what in a sample of requests breaks prefix reuse.

Reads a JSONL file of OpenAI request bodies (chat or completions), one per line, in arrival
order, either bare or wrapped as ``{"body": {...}, "session": "..."}`` (the form the
router's own opt-in sample writes, ``audit_sample`` in the config). Renders each prompt the
way the router does for text routing, and hands the rest to ``core/prefix_audit.py``. Prints
a summary and the findings, or with ``--json`` the report as JSON. Every input error exits
with status 2 and one line on stderr saying which line and what to fix.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from kvroute.commands.tables import rows_table, wide_console
from kvroute.core.prefix_audit import AuditReport, AuditRequest, audit
from kvroute.wire.openai import Endpoint, ParsedRequest, RequestError, parse_request
from kvroute.wire.relay import routing_text

HELP = ("Report what breaks prefix reuse in sampled requests (JSONL of OpenAI bodies): "
        "volatile values early in prompts, reordered tools or history, per-request system "
        "prompts, and the share of prompt tokens that could have been cache hits.")

USAGE_ERROR = 2


def _fail(message: str) -> NoReturn:
    typer.echo(f"kvroute audit: {message}", err=True)
    raise typer.Exit(USAGE_ERROR)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _tool_name(tool: Any) -> str:
    if isinstance(tool, dict):
        fn = tool.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return str(fn["name"])
        if isinstance(tool.get("name"), str):
            return str(tool["name"])
    return json.dumps(tool, sort_keys=True)[:60]


def audit_request(parsed: ParsedRequest, session: str | None) -> AuditRequest:
    """One parsed body as the audit reads it."""
    tools = list(parsed.tools or [])
    names = tuple(_tool_name(t) for t in tools)
    text = routing_text(parsed)
    sorted_text = text
    if tools:
        ordered = [t for _, t in sorted(zip(names, tools, strict=True), key=lambda p: p[0])]
        sorted_text = routing_text(dataclasses.replace(parsed, tools=ordered))
    messages = tuple(f"{m.get('role', '')}: {_text(m.get('content'))}"
                     for m in (parsed.messages or []))
    system = next((_text(m.get("content")) for m in (parsed.messages or [])
                   if m.get("role") in ("system", "developer")), None)
    if session is None:
        session = parsed.session_id or parsed.user
    if session is None and parsed.messages:
        session = next((_text(m.get("content"))[:200] for m in parsed.messages
                        if m.get("role") == "user"), None)
    return AuditRequest(route=parsed.model, text=text, tools_sorted_text=sorted_text,
                        system=system, tool_names=names, messages=messages, session=session)


def read_sample(path: Path) -> Iterator[AuditRequest]:
    """The sample's requests, in file order.

    Raises:
        ValueError: a line is not JSON, not an object, or not a valid OpenAI body (the
            message names the line).
    """
    with path.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not JSON ({exc.msg})") from exc
            if not isinstance(doc, dict):
                raise ValueError(  # noqa: TRY004 (one documented error type for bad input)
                    f"{path}:{number} is not a JSON object")
            wrapped = doc.get("body")
            body: dict[str, Any] = wrapped if isinstance(wrapped, dict) else doc
            session = doc.get("session") if isinstance(doc.get("session"), str) else None
            endpoint: Endpoint = "chat" if "messages" in body else "completions"
            try:
                parsed = parse_request(json.dumps(body).encode(), endpoint)
            except RequestError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from exc
            yield audit_request(parsed, session)


def report_json(report: AuditReport, block_size: int) -> dict[str, Any]:
    return {
        "requests": report.requests,
        "estimated": "tokens are characters / 4; blocks are block_size such tokens",
        "block_size": block_size,
        "prompt_tokens": report.prompt_tokens,
        "reused_tokens": report.reused_tokens,
        "reusable_tokens": report.reusable_tokens,
        "reused_share": round(report.reused_share, 4),
        "lost_share": round(report.lost_share, 4),
        "divergence_blocks": dict(sorted(report.divergence_blocks.items())),
        "findings": [dataclasses.asdict(f) for f in report.findings],
    }


def _print(report: AuditReport, block_size: int) -> None:
    out = wide_console()
    share = f"{report.lost_share:.1%}"
    out.print(f"{report.requests} requests, ~{report.prompt_tokens} prompt tokens (4 chars a "
              f"token, blocks of {block_size}): {report.reused_share:.1%} reused from earlier "
              f"requests, {share} more could have been with stable prompts.")
    if report.divergence_blocks:
        top = ", ".join(f"block {b}: {n}" for b, n in sorted(report.divergence_blocks.items())[:8])
        out.print(f"first block not reused: {top}")
    rows = [["finding", "requests", "first block", "tokens lost", "example"]]
    rows += [[f.kind, str(f.requests), str(f.first_block), str(f.lost_tokens), f.example]
             for f in report.findings]
    out.print(rows_table("what breaks prefix reuse", rows, left=("finding", "example")))


def audit_cmd(
    sample: Annotated[Path, typer.Argument(help="JSONL of OpenAI request bodies, in arrival order.")],
    block_size: Annotated[int, typer.Option(help="Tokens per block (the engines' block size).")] = 16,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Audit a sample of requests for what breaks prefix reuse."""
    if not sample.is_file():
        _fail(f"{sample} is not a file: give a JSONL of request bodies")
    if block_size < 1:
        _fail(f"--block-size must be >= 1, got {block_size}")
    try:
        report = audit(read_sample(sample), block_size=block_size)
    except ValueError as exc:
        _fail(str(exc))
    if json_out:
        typer.echo(json.dumps(report_json(report, block_size), indent=2))
    else:
        _print(report, block_size)
