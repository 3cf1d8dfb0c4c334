"""Which code a benchmark measured: the git commit written into its report.

One helper for every report (``kvroute bench sim/live/tiers/tiers-live`` and the scripts in
``benchmarks/micro``), so a figure can always be traced to the commit that produced it, and a
missing ``git`` or a run outside a checkout never costs the run: the commit is then None.
"""

from __future__ import annotations

import os
import subprocess

__all__ = ["git_sha"]


def git_sha(*, short: bool = False, cwd: str | os.PathLike[str] | None = None,
            timeout_s: float | None = 5.0) -> str | None:
    """The commit checked out (``git rev-parse HEAD``), or None when it cannot be told.

    Args:
        short: the abbreviated form (``--short``) instead of the full 40 hex digits.
        cwd: where to ask (the checkout containing it); the current directory when None.
        timeout_s: how long git may take (None: no limit).

    Returns None when git is missing, ``cwd`` is no checkout, or git fails or times out.
    """
    args = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        done = subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=timeout_s,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None
