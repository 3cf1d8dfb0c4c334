"""``kvroute hash``: print the vLLM block hashes of a token sequence.

An operator's check that the router and an engine agree: hash the token ids an engine logged
(or a KV event carried) with the engine's block size, algorithm and seed, and compare the
``WIREINT`` column with the event's ``block_hashes``. Owns only argument parsing and output;
the hashing is :class:`kvroute.core.hashing.BlockHasher`.

Output: one line per full block, ``INDEX HEXDIGEST WIREINT`` (single spaces), or with
``--json`` a JSON list of ``{"index", "hex", "wire"}`` objects. Every input error exits with
status 2 and one line on stderr saying what to fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from kvroute.core.errors import HashConfigError
from kvroute.core.hashing import HASH_ALGOS, BlockHasher, LoraKey
from kvroute.core.types import to_wire_hash

HELP = (
    "Print vLLM prefix-cache block hashes of TOKEN ids: one line per full block, "
    "'INDEX HEXDIGEST WIREINT' (WIREINT is the 64-bit form in KV events)."
)

USAGE_ERROR = 2


def _fail(message: str) -> NoReturn:
    typer.echo(f"kvroute hash: error: {message}", err=True)
    raise typer.Exit(code=USAGE_ERROR)


def _parse_tokens(raw: list[str]) -> list[int]:
    tokens: list[int] = []
    for position, text in enumerate(raw):
        try:
            value = int(text, 10)
        except ValueError:
            _fail(f"token {position} is {text!r}, not an integer: pass token ids such as 1 2 3")
        if value < 0:
            _fail(f"token {position} is {value}: token ids must be non-negative")
        tokens.append(value)
    return tokens


def _read_tokens_file(path: Path) -> list[int]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        _fail(f"cannot read --tokens-file {str(path)!r}: {exc.strerror or exc}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        _fail(
            f"--tokens-file {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno} "
            f"column {exc.colno}): it must hold a JSON list of token ids, e.g. [1, 2, 3]"
        )
    if not isinstance(data, list):
        _fail(
            f"--tokens-file {str(path)!r} holds a JSON {type(data).__name__}, not a list: it "
            "must hold a JSON list of token ids, e.g. [1, 2, 3]"
        )
    for position, value in enumerate(data):
        if type(value) is not int or value < 0:
            _fail(
                f"--tokens-file {str(path)!r}: item {position} is {json.dumps(value)}, not a "
                "non-negative integer token id"
            )
    return data


def hash_tokens(
    tokens: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="TOKEN...", help="Token ids (non-negative integers).", show_default=False
        ),
    ] = None,
    block_size: Annotated[
        int,
        typer.Option(
            "--block-size",
            help="The engine's effective block size (block_size in vllm:cache_config_info).",
        ),
    ] = 16,
    algo: Annotated[
        str,
        typer.Option(
            "--algo", help=f"--prefix-caching-hash-algo of the engine: {', '.join(HASH_ALGOS)}."
        ),
    ] = "sha256",
    seed: Annotated[
        str | None,
        typer.Option(
            "--seed",
            help="The engine's PYTHONHASHSEED, verbatim (required for xxhash*; omit if unset).",
        ),
    ] = None,
    cache_salt: Annotated[
        str | None, typer.Option("--cache-salt", help="The request's cache_salt (block 0 only).")
    ] = None,
    lora_name: Annotated[
        str | None, typer.Option("--lora-name", help="LoRA adapter name (needs --lora-path).")
    ] = None,
    lora_path: Annotated[
        str | None,
        typer.Option("--lora-path", help="Path the adapter was loaded from (root on /v1/models)."),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print a JSON list of {index, hex, wire}.")
    ] = False,
    tokens_file: Annotated[
        Path | None,
        typer.Option("--tokens-file", help="Read the token ids from a JSON list in this file."),
    ] = None,
) -> None:
    """Print the vLLM block hashes of a token sequence."""
    if tokens and tokens_file is not None:
        _fail("give the token ids either as arguments or with --tokens-file, not both")
    if tokens_file is not None:
        token_ids = _read_tokens_file(tokens_file)
    elif tokens:
        token_ids = _parse_tokens(tokens)
    else:
        _fail("no token ids: pass them as arguments (kvroute hash 1 2 3) or with --tokens-file")
    if (lora_name is None) != (lora_path is None):
        _fail(
            "--lora-name and --lora-path go together: vLLM hashes both the adapter name and "
            "the path it was loaded from (root on /v1/models)"
        )
    try:
        hasher = BlockHasher(algo=algo, block_size=block_size, seed=seed)
        lora = None
        if lora_name is not None and lora_path is not None:
            lora = LoraKey(lora_name, lora_path)
        digests = hasher.hash_blocks(token_ids, cache_salt=cache_salt, lora=lora)
    except (HashConfigError, ValueError) as exc:
        _fail(str(exc))
    if not digests:
        typer.echo(
            f"kvroute hash: note: {len(token_ids)} token(s) is less than one full block of "
            f"{block_size}; vLLM hashes only full blocks, so there is nothing to print",
            err=True,
        )
        return
    rows = [
        {"index": index, "hex": digest.hex(), "wire": to_wire_hash(digest)}
        for index, digest in enumerate(digests)
    ]
    if json_output:
        typer.echo(json.dumps(rows))
    else:
        for row in rows:
            typer.echo(f"{row['index']} {row['hex']} {row['wire']}")
