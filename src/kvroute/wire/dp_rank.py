"""vLLM's data-parallel ranks on the wire: the request header and the per-rank endpoints.

One vLLM API server can front several data-parallel (DP) engine ranks
(``--data-parallel-size N``): each rank is its own engine core with its own batch and its own
KV cache, and each publishes its own KV-event stream. A router reaches a rank through the
one HTTP port by naming it in a request header; it reads a rank's events on that rank's own
ZMQ port. This module holds both conventions, as vLLM 0.32 defines them:

* ``X-data-parallel-rank: r`` pins the request to rank ``r``
  (``vllm/entrypoints/generate/base/serving.py``); without it the API server's load balancer
  picks the rank. A rank outside ``[0, N)`` is refused.
* ``offset_endpoint_port(endpoint, r)`` (``vllm/distributed/kv_events.py``): rank ``r``
  publishes on the configured ``tcp`` endpoint's port + ``r`` (port 0 stays 0: every rank
  binds its own free port), on ``inproc`` endpoints with ``_dp{r}`` appended; rank 0 is the
  endpoint unchanged; any other scheme with a rank above 0 is an error. It applies to the
  replay endpoint too. Every batch also carries the rank (``data_parallel_rank``).
* ``rank_count(engines)``: the rank count the ``engine`` label values of the API server's
  ``/metrics`` show (vLLM labels every series of rank r with ``engine="r"``), so a router can
  learn ``--data-parallel-size`` instead of being told it.

Pure: strings in, strings out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

__all__ = ["DP_RANK_HEADER", "DpRankError", "offset_endpoint_port", "parse_dp_rank",
           "rank_count"]

DP_RANK_HEADER: Final = "X-data-parallel-rank"
"""vLLM's request header naming the DP rank that serves the request."""


class DpRankError(ValueError):
    """A DP rank header or endpoint that vLLM would refuse; the message says why."""


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """Rank ``rank``'s endpoint of a DP engine configured with ``endpoint`` (vLLM's rule).

    Raises:
        DpRankError: ``rank`` is negative, or above 0 on a scheme other than tcp/inproc.
    """
    if rank < 0:
        raise DpRankError(f"data-parallel rank {rank} must be >= 0")
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        head, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise DpRankError(f"endpoint {endpoint!r} has no port to offset for rank {rank}; "
                              'write it as "tcp://host:PORT"')
        number = int(port)
        return endpoint if number == 0 else f"{head}:{number + rank}"
    raise DpRankError(f"endpoint {endpoint!r} cannot serve data-parallel rank {rank}: vLLM "
                      "offsets only tcp and inproc endpoints per rank (use tcp://host:PORT)")


def parse_dp_rank(value: str, size: int) -> int:
    """The rank an ``X-data-parallel-rank`` header names, for an engine of ``size`` ranks.

    Raises:
        DpRankError: not an integer, or outside ``[0, size)`` (vLLM answers 400).
    """
    text = value.strip()
    try:
        rank = int(text)
    except ValueError:
        raise DpRankError(f"{DP_RANK_HEADER} must be an integer rank, got {value!r}") from None
    if not 0 <= rank < size:
        raise DpRankError(f"data_parallel_rank {rank} is out of range [0, {size}).")
    return rank


def rank_count(engines: Iterable[str]) -> int | None:
    """The number of data-parallel ranks behind an API server, from the ``engine`` label
    values its ``/metrics`` carries (``"0"`` .. ``"N-1"``); None when no series has the label
    (an engine that does not say). One label of any rank is one engine: a server of an
    externally balanced deployment (``--data-parallel-rank``) fronts its own rank alone.

    Raises:
        DpRankError: a value is not a rank number, or several ranks that are not ``0`` ..
            ``N-1`` (a rank missing from the exposition, or a server fronting some ranks of
            a larger deployment: the header's rank numbers cannot be derived from them).
    """
    labels = set(engines)
    if not labels:
        return None
    if not all(label.isdigit() for label in labels):
        raise DpRankError(f"engine labels {sorted(labels)} are not data-parallel rank numbers")
    if len(labels) == 1:
        return 1
    ranks = sorted(int(label) for label in labels)
    if ranks != list(range(len(ranks))):
        raise DpRankError(f"engine labels {[str(r) for r in ranks]} are not the ranks 0 .. "
                          f"{len(ranks) - 1}: a rank is missing from /metrics")
    return len(ranks)
