"""How long a simulated engine's answers are when nothing else says: a model ends its answers.

Owns the answer length a simulated engine gives a request that does not fix one itself. A
real model stops when it samples EOS; the engine model (``engine/model.py``) never samples, it
ends a request at its ``output_length`` (finish ``"stop"``) or at ``max_tokens`` (finish
``"length"``). Without a length, a chat request with no ``max_tokens`` would run to the
context window: 131,066 tokens for a one-word "hello" (issue #25).

``AnswerLengths.natural`` draws each answer's length from a log-normal distribution, the shape
answer lengths of chat models have in public conversation logs: most answers a few hundred
tokens, a long tail of long ones. The defaults (median 180 tokens, sigma 0.9: mean ~270,
~10% above 570, ~1% above 1,500; clipped to 1..4096) are chosen to resemble ShareGPT-style
chat answers, not fitted to one model.

The draw is deterministic per request: a keyed BLAKE2b of the engine's seed, the prompt's
token ids, the request's own ``seed`` and its choice index gives the uniform variate, so the
same request to the same engine gets the same length every time, and two engines started
with the same seed agree. No global random generator is used: the module
is pure (``tests/unit/test_layering.py``, ``PURE_MODULES``).

What still fixes a length: ``eos_after_tokens`` (every request stops after that many tokens),
the request's ``max_tokens`` (a cap: ``"length"`` when the draw is longer), and vLLM's own
``ignore_eos: true`` sampling parameter (run to ``max_tokens``, as benchmarks that give each
request its trace's output length ask real vLLM to do).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Final

from kvroute.core.errors import ConfigError

__all__ = ["ANSWER_LENGTH_MODES", "AnswerLengths"]

ANSWER_LENGTH_MODES: Final = ("natural", "max-tokens")
"""``natural``: a drawn length ending with ``stop``; ``max-tokens``: run to ``max_tokens``
(or the window), as vLLM with ``ignore_eos``."""

_STANDARD: Final = NormalDist()
_U64: Final = float(1 << 64)


@dataclass(frozen=True, slots=True)
class AnswerLengths:
    """A seeded log-normal distribution of answer lengths, in tokens.

    Attributes:
        median_tokens: the distribution's median (``exp(mu)``).
        sigma: the log-normal's shape (standard deviation of the log length).
        min_tokens / max_tokens: the clip bounds of every draw.
        seed: mixed into every draw: engines with different seeds answer differently.
    """

    median_tokens: float = 180.0
    sigma: float = 0.9
    min_tokens: int = 1
    max_tokens: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.median_tokens >= 1.0:
            raise ConfigError(f"answer median_tokens={self.median_tokens!r} must be >= 1")
        if not 0.0 <= self.sigma <= 4.0:
            raise ConfigError(f"answer sigma={self.sigma!r} must be between 0 and 4")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(
                f"answer lengths need 1 <= min_tokens <= max_tokens, got "
                f"min_tokens={self.min_tokens} max_tokens={self.max_tokens}"
            )

    def length_for(self, prompt_token_ids: Sequence[int], *, request_seed: int | None = None,
                   choice: int = 0) -> int:
        """The answer length of one choice of one request (deterministic, see the module)."""
        key = hashlib.blake2b(digest_size=8, key=self.seed.to_bytes(8, "big", signed=True))
        key.update(len(prompt_token_ids).to_bytes(8, "big"))
        key.update(b"".join(t.to_bytes(4, "big", signed=True) for t in prompt_token_ids))
        key.update(b"-" if request_seed is None else request_seed.to_bytes(9, "big", signed=True))
        key.update(choice.to_bytes(4, "big"))
        # A uniform variate strictly inside (0, 1): the digest's 64 bits, centred in their cell.
        uniform = (int.from_bytes(key.digest(), "big") + 0.5) / _U64
        drawn = math.exp(math.log(self.median_tokens) + self.sigma * _STANDARD.inv_cdf(uniform))
        return max(self.min_tokens, min(self.max_tokens, round(drawn)))
