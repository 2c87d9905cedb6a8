"""Import-only stand-in (see torchvision/_standin.py)."""

from typing import Any

from torchvision._standin import standin


def __getattr__(name: str) -> Any:
    return standin(__name__, name)
