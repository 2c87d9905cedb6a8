"""One option vocabulary for every strategy, so that switching strategy is a change of name.

``metadist.strategy(name, **options)`` takes the options of any strategy. An option of
another strategy is checked as that strategy checks it (type and value: a wrong one raises
the same error there), then ignored: silently when its value means "off" (None, False, an
empty tuple, or the default of a strategy that has it), otherwise with one warning per
(strategy, option) naming the strategies that use it. A name that no strategy has is an
error (raised by the registry, which lists the valid names).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any

#: Every option name -> the (registered name, config class) of the strategies that have it.
Owners = dict[str, list[tuple[str, type[Any]]]]

_WARNED: set[tuple[str, str]] = set()


def options_of(configs: Iterable[tuple[str, type[Any]]]) -> Owners:
    """Who has which option, from (strategy name, config dataclass) in the order to report."""
    owners: Owners = {}
    for name, config in configs:
        for field in dataclasses.fields(config):
            owners.setdefault(field.name, []).append((name, config))
    return owners


def _means_off(value: Any, defaults: list[Any]) -> bool:
    if value is None or value is False or (isinstance(value, (tuple, list)) and not value):
        return True
    # 25 is bucket_cap_mb's 25.0, but True is not min_unit_params=1
    return any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


def check_foreign(strategy: str, option: str, value: Any,
                  owners: list[tuple[str, type[Any]]]) -> None:
    """``option`` belongs to ``owners``, not to ``strategy``: validate it as the first owner
    does, then let it be ignored (warning once unless it means "off")."""
    owners[0][1](**{option: value})  # that strategy's type and value checks
    defaults = [f.default for _, config in owners for f in dataclasses.fields(config)
                if f.name == option and f.default is not dataclasses.MISSING]
    if _means_off(value, defaults) or (strategy, option) in _WARNED:
        return
    _WARNED.add((strategy, option))
    users = ", ".join(name for name, _ in owners)
    warnings.warn(
        f"strategy {strategy!r} ignores option {option}={value!r}: only {users} use it. It is "
        "accepted so that a script can switch strategies without editing its options; "
        "drop it to silence this warning", UserWarning, stacklevel=3)
