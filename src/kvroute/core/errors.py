"""kvroute's exception hierarchy.

Normal outcomes (a cache miss, zero overlap, no capacity) are return values, never
exceptions. Exceptions are for input that is wrong or state that cannot be trusted, and
every message says what was wrong and how to fix it.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base of every error kvroute raises on purpose."""


class ConfigError(RouterError):
    """A configuration value is invalid; the message names the key, the value and the fix."""


class HashConfigError(ConfigError):
    """Block hashing cannot be set up as asked (unknown algorithm, missing seed, bad size)."""


class MalformedEventError(RouterError):
    """Bytes from a KV-event stream could not be decoded; the message names what was wrong.

    This is the only exception the event codec lets escape for bad input.
    """


class ScopeError(RouterError):
    """A prefix-index lookup did not carry a tenant scope or an admin capability."""


class NoEligibleReplica(RouterError):
    """No replica can serve a request (all unhealthy, or the pool is empty)."""
