"""The strategies' names: ``@register`` makes a strategy available under a name and aliases,
and ``metadist.strategy(name, **options)`` builds one, accepting (and checking) another
strategy's options so that switching strategy is a change of name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from metadist.strategies.options import check_foreign, options_of

if TYPE_CHECKING:
    from metadist.strategies.base import Strategy

_REGISTRY: dict[str, type[Strategy]] = {}
_ALIASES: dict[str, str] = {}

S = TypeVar("S", bound="type[Strategy]")


def register(name: str, *aliases: str) -> Callable[[S], S]:
    """Class decorator: make a strategy available under ``name`` and ``aliases``."""
    def decorate(cls: S) -> S:
        cls.name = name
        _REGISTRY[name] = cls
        for alias in aliases:
            _ALIASES[alias] = name
        return cls

    return decorate


_ORDER = ("single", "dp", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")


def available() -> list[str]:
    """Every strategy name and alias, from the least to the most sharded."""
    names = [*_REGISTRY, *_ALIASES]
    return sorted(names, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))


def canonical(name: str) -> str:
    """The registered name an alias stands for (``"distributed"`` -> ``"ddp"``)."""
    return _ALIASES.get(name, name)


def strategy(name: str, **options: Any) -> Strategy:
    """Build a configured strategy: ``metadist.strategy("ddp", bucket_cap_mb=50)``.

    Another strategy's options are accepted, checked and ignored (strategies/options.py),
    so that switching strategy is a change of name; a name no strategy has raises."""
    key = _ALIASES.get(name, name)
    cls = _REGISTRY.get(key)
    if cls is None:
        raise ValueError(f"strategy {name!r} is not known; choose one of: {', '.join(available())}")
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    ordered = sorted(_REGISTRY, key=lambda n: _ORDER.index(n) if n in _ORDER else len(_ORDER))
    owners = options_of((n, _REGISTRY[n].Config) for n in ordered)
    unknown = sorted(set(options) - fields - set(owners))
    if unknown:
        others = sorted(set(owners) - fields)
        raise ValueError(
            f"strategy {key!r} has no option(s) {', '.join(map(repr, unknown))}, and no other "
            f"strategy has; valid options: {', '.join(sorted(fields)) or '(none)'}"
            + (f" (other strategies' options, accepted and ignored here: {', '.join(others)})"
               if others else ""))
    for option in sorted(set(options) - fields):
        check_foreign(key, option, options[option], owners[option])
    return cls(cls.Config(**{k: v for k, v in options.items() if k in fields}))


__all__ = ["available", "canonical", "register", "strategy"]
