"""``--policy-param KEY=VALUE``: policy overrides from the command line, checked before a run.

Each item is ``KEY=VALUE`` (for every selected policy) or ``POLICY.KEY=VALUE`` (for that one).
An unscoped key must exist in *every* selected policy: a parameter silently applied to some
policies and not others would make a comparison lie, so the error names the policies that
lack it, what each takes, and the scoped form to use. Values follow the parameter's type as
the policy's constructor declares it (``core.peer_policies.policy_parameters``): ``float``
(any number but NaN), ``int``, or ``bool`` (``true``/``false``, ``1``/``0``, ``yes``/``no``,
``on``/``off``). Every policy is then built once with its overrides, so a value it refuses
(a negative weight) fails here too, before any simulation starts.

Pure: no I/O; errors are ``ConfigError`` with the item as the user typed it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from kvroute.core.errors import ConfigError
from kvroute.core.peer_policies import make_policy, policy_parameters

__all__ = ["PolicyParams", "parse_policy_params"]

PolicyParams = dict[str, dict[str, float | bool]]
"""Policy name -> its parameter overrides."""

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _value(item: str, key: str, text: str, kind: str) -> float | bool:
    word = text.strip().lower()
    if kind == "bool" or (kind not in ("int", "float") and word in _TRUE | _FALSE):
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise ConfigError(f"--policy-param {item!r}: {key} is a bool; give true or false")
    try:
        if kind == "int":
            return int(word)
        value = float(word)
    except ValueError:
        raise ConfigError(
            f"--policy-param {item!r}: {key} takes {'an integer' if kind == 'int' else 'a number'}"
            f", got {text!r}"
        ) from None
    if math.isnan(value):
        raise ConfigError(f"--policy-param {item!r}: {key} must be a number, not NaN")
    return value


def _known(policies: Sequence[str]) -> str:
    return "; ".join(
        f"{name} takes {', '.join(params) if params else 'no parameters'}"
        for name, params in ((p, policy_parameters(p)) for p in policies)
    )


def parse_policy_params(items: Sequence[str], policies: Sequence[str]) -> PolicyParams:
    """Each selected policy's overrides from ``items`` (module docstring).

    Raises:
        ConfigError: an item that is not ``[POLICY.]KEY=VALUE``, a policy not among
            ``policies``, a parameter a targeted policy does not take, a value of the wrong
            type, or a value the policy refuses.
    """
    out: PolicyParams = {name: {} for name in policies}
    for item in items:
        target, sep, text = item.partition("=")
        if not sep or not target.strip():
            raise ConfigError(f"--policy-param takes KEY=VALUE or POLICY.KEY=VALUE, got {item!r}")
        scope, dot, key = target.strip().rpartition(".")
        targets = [scope] if dot else list(policies)
        if dot and scope not in policies:
            raise ConfigError(
                f"--policy-param {item!r}: policy {scope!r} is not among the policies run "
                f"({', '.join(policies)})"
            )
        lacking = [p for p in targets if key not in policy_parameters(p)]
        if lacking:
            having = [p for p in policies if key in policy_parameters(p)]
            hint = (f"; to set it for {having[0]} only, write {having[0]}.{key}={text}"
                    if having and not dot else "")
            who = (f"policy {lacking[0]!r} has" if len(lacking) == 1
                   else f"policies {', '.join(map(repr, lacking))} have")
            raise ConfigError(
                f"--policy-param {item!r}: {who} no parameter {key!r} ({_known(lacking)}){hint}"
            )
        for policy in targets:
            out[policy][key] = _value(item, key, text, policy_parameters(policy)[key])
    for policy, params in out.items():
        if params:
            make_policy(policy, random.Random(0), **params)
    return out
