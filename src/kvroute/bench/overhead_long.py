"""Growing agentic sessions up to 128K real tokens: the workload, a turn-by-turn CPU sweep and
its plot, for ``kvroute bench overhead`` (its ``g<sessions>`` phases and ``--long-sweep``).

A session opens with a ~8,000-character system prompt and a short task, then grows by one
turn at a time: a short assistant message and a tool result of ``turn_chars`` characters,
until the prompt passes ``target_tokens``. Token counts are *real*: the rendered chat prompt
encoded by the engines' own tokenizer (the bundled one, which the simulated engines serve),
so "128K" means what an engine would count. Each turn asks for 8 output tokens (one can
decode to no text, which the client counts as an error); TTFT is the figure read. The text is
words of one random vocabulary drawn with Zipf weights (``Language``); no two sessions or
turns share text beyond their own history. Each session names itself in the body's ``user``
field, which kvroute reads as its session id and the peers pass through.

Two uses:

* ``long_session_requests``: every turn of ``sessions`` sessions, turn-major (turn 1 of every
  session, then turn 2...), so several long sessions are in flight at once; a ``g`` phase of
  the overhead benchmark sends them at a fixed rate, with the same-window baseline when asked.
  Their ``group`` is ``long-<tokens>`` so the report can quote the turns near the target.
* ``run_long_sweep``: one router, one session at a time, one turn at a time; each turn's
  router CPU is read from ``/proc/<pid>/task/*/schedstat`` (nanoseconds, every thread of the
  router's process tree) before the turn and after its answer plus a short settle (the KV
  events the turn caused are the router's work for it too). Sessions of several growth sizes
  make new tokens and total tokens vary independently, which ``plot_long_sweep`` draws:
  router CPU against new tokens and against total tokens.

Bounds: every turn is one request with ``request_timeout_s``; a sweep is at most
``len(growth_chars) * max_turns`` turns. Loopback only.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvroute.bench.live_client import LiveRequest
from kvroute.bench.procfs import descendants
from kvroute.core.errors import ConfigError
from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir

__all__ = ["DEFAULT_GROWTH_CHARS", "LONG_TARGET_TOKENS", "LongTurn", "long_session_requests",
           "plot_long_sweep", "run_long_sweep", "tree_cpu_ns"]

LONG_TARGET_TOKENS: Final = 131_072
"""Sessions grow until their prompt passes this many tokens."""
LONG_MAX_MODEL_LEN: Final = 262_144
"""The engines' window in a run with long sessions (a prompt above the target must fit)."""
TURN_CHARS: Final = 7_800
"""A tool result of the issue's example: ~6K tokens of the bundled tokenizer."""
DEFAULT_GROWTH_CHARS: Final = (1_000, 4_000, 10_000, 20_000)
"""Per-turn growth of the sweep's sessions (about 0.8K to 16K new tokens a turn)."""
_SYSTEM_CHARS: Final = 8_000
_MAX_TURNS: Final = 400
_VOCABULARY: Final = 20_000


class Language:
    """Text as a tool or a person writes it, to the tokenizer's eye: words of a fixed
    vocabulary (``_VOCABULARY`` random lowercase words of 2-9 letters) drawn with Zipf
    weights, so common words recur and rare ones are new, as in prose and code. (Words of
    random letters each time would make every word new to the tokenizer's word cache and
    cost several times its usual CPU a token, on the router and the engines alike.)"""

    def __init__(self, seed: int) -> None:
        rng = random.Random(f"vocabulary-{seed}")
        self.words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                              for _ in range(rng.randint(2, 9))) for _ in range(_VOCABULARY)]
        self.cum_weights = list(itertools.accumulate(1.0 / (rank + 1)
                                                     for rank in range(_VOCABULARY)))

    def text(self, rng: random.Random, nchars: int) -> str:
        out: list[str] = []
        n = 0
        while n < nchars:
            batch = rng.choices(self.words, cum_weights=self.cum_weights, k=64)
            out += batch
            n += sum(map(len, batch)) + len(batch)
        return " ".join(out)[:nchars]


@dataclass(frozen=True, slots=True)
class LongTurn:
    """One turn of a growing session: its body, its prompt's real token count, and how many
    of those tokens the previous turn did not have."""

    session: str
    turn: int
    body: bytes
    prompt_tokens: int
    new_tokens: int


def _session_turns(name: str, rng: random.Random, language: Language,
                   tokenizer: HFTokenizer, *, model: str, turn_chars: int, target_tokens: int,
                   stream: bool, max_tokens: int) -> list[LongTurn]:
    words = language.text
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a coding agent. " + words(rng, _SYSTEM_CHARS)},
        {"role": "user", "content": "Do the task. " + words(rng, 400)},
    ]
    out: list[LongTurn] = []
    previous = 0
    for turn in range(_MAX_TURNS):
        text = tokenizer.render_chat(messages)
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                                "stream": stream, "temperature": 0.0, "user": name}
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append(LongTurn(name, turn, json.dumps(body).encode(), tokens, tokens - previous))
        if tokens >= target_tokens:
            break
        previous = tokens
        messages = [*messages,
                    {"role": "assistant", "content": "Calling a tool: " + words(rng, 60)},
                    {"role": "user", "content": "Tool result: " + words(rng, turn_chars)}]
    return out


def long_session_requests(sessions: int, *, model: str, seed: int = 0, rate: float = 2.0,
                          stream: bool = True, turn_chars: int = TURN_CHARS,
                          target_tokens: int = LONG_TARGET_TOKENS, max_tokens: int = 8,
                          prefix: str = "g") -> list[LiveRequest]:
    """Every turn of ``sessions`` growing sessions, turn-major, one every ``1 / rate`` s.

    Raises:
        ConfigError: ``sessions`` < 1, ``rate`` not > 0, or a size below 1.
    """
    if sessions < 1 or not rate > 0 or turn_chars < 1 or target_tokens < 1:
        raise ConfigError(f"long sessions: sessions={sessions} must be >= 1, rate={rate} > 0, "
                          f"turn_chars={turn_chars} and target_tokens={target_tokens} >= 1")
    tokenizer = HFTokenizer.from_dir(bundled_tokenizer_dir())
    rng = random.Random(seed)
    language = Language(seed)
    per_session = [_session_turns(f"{prefix}-{seed}-{s}", rng, language, tokenizer, model=model,
                                  turn_chars=turn_chars, target_tokens=target_tokens,
                                  stream=stream, max_tokens=max_tokens)
                   for s in range(sessions)]
    ordered = [turns[t] for t in range(max(map(len, per_session)))
               for turns in per_session if t < len(turns)]
    return [LiveRequest(f"{t.session}-t{t.turn}", i / rate, t.body, t.prompt_tokens, max_tokens,
                        f"long-{t.prompt_tokens}", stream)
            for i, t in enumerate(ordered)]


def tree_cpu_ns(pid: int) -> int:
    """CPU nanoseconds of ``pid`` and its descendants, every thread, from ``schedstat`` (finer
    than ``stat``'s clock ticks, which count 10 ms at a time). Threads that end between two
    reads take their time with them: read around work the threads outlive."""
    total = 0
    for proc in (pid, *descendants(pid)):
        try:
            tasks = os.listdir(f"/proc/{proc}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{proc}/task/{task}/schedstat", "rb") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total


def _send(url: str, body: bytes, timeout_s: float) -> tuple[float, int]:
    """POST ``body``; seconds to the first byte of the answer and its status."""
    request = urllib.request.Request(url, data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:  # loopback only
        resp.read(1)
        first = time.perf_counter() - started
        resp.read()
        return first, int(resp.status)


def run_long_sweep(router_url: str, router_pid: int | None, *, model: str, seed: int = 0,
                   growth_chars: Sequence[int] = DEFAULT_GROWTH_CHARS,
                   target_tokens: int = LONG_TARGET_TOKENS, settle_s: float = 0.05,
                   request_timeout_s: float = 60.0,
                   on_turn: Callable[[dict[str, Any]], None] | None = None
                   ) -> list[dict[str, Any]]:
    """One session per growth size, turn by turn, through ``router_url``; per turn: session,
    turn, total and new tokens, time to the first byte, and the router's CPU (None for the
    direct baseline, which has no process).

    Raises:
        ConfigError: an empty or non-positive growth size.
    """
    if not growth_chars or min(growth_chars) < 1:
        raise ConfigError(f"growth_chars={list(growth_chars)} must be sizes >= 1")
    url = router_url + "/v1/chat/completions"
    rows: list[dict[str, Any]] = []
    for k, chars in enumerate(growth_chars):
        turns = long_session_requests(1, model=model, seed=seed * 1000 + k, stream=True,
                                      turn_chars=chars, target_tokens=target_tokens,
                                      prefix=f"sweep{chars}")
        previous = 0
        for req in turns:
            before = tree_cpu_ns(router_pid) if router_pid is not None else None
            first_s, status = _send(url, req.body, request_timeout_s)
            time.sleep(settle_s)
            after = tree_cpu_ns(router_pid) if router_pid is not None else None
            row = {"growth_chars": chars, "request_id": req.request_id,
                   "total_tokens": req.prompt_tokens,
                   "new_tokens": req.prompt_tokens - previous,
                   "first_byte_ms": round(first_s * 1e3, 3), "status": status,
                   "router_cpu_ms": None if before is None or after is None
                   else round((after - before) / 1e6, 3)}
            previous = req.prompt_tokens
            rows.append(row)
            if on_turn is not None:
                on_turn(row)
    return rows


def plot_long_sweep(rows_by_router: dict[str, list[dict[str, Any]]], path: Path,
                    *, title: str) -> None:
    """Router CPU per turn against new tokens (left) and against total tokens (right), one
    colour per router (a session's first turn counts all its tokens as new)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for router, rows in rows_by_router.items():
        pts = [r for r in rows if r["router_cpu_ms"] is not None]
        if not pts:
            continue
        left.scatter([r["new_tokens"] / 1000 for r in pts], [r["router_cpu_ms"] for r in pts],
                     s=10, label=router, alpha=0.7)
        right.scatter([r["total_tokens"] / 1000 for r in pts],
                      [r["router_cpu_ms"] for r in pts], s=10, label=router, alpha=0.7)
    left.set_xlabel("new tokens in the turn (thousands)")
    right.set_xlabel("total prompt tokens (thousands)")
    left.set_ylabel("router CPU per turn (ms, /proc schedstat)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
