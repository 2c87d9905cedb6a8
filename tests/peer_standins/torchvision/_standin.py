"""An import-only torchvision for learn2learn (whose import reaches torchvision's transforms
and datasets): every name resolves to a class that raises when used. The registry's
torchvision for torch 2.13 is a CUDA build; the suite never uses torchvision itself."""

from __future__ import annotations

from typing import Any


def standin(module: str, name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{module}.{name} is the test suite's import-only torchvision "
                           "stand-in (tests/peer_standins): nothing of torchvision runs here")

    return type(name, (), {"__init__": refuse, "__module__": module})
