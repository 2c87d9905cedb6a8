"""Import-only stand-in (see torchvision/_standin.py)."""

from typing import Any

from torchvision import datasets, transforms  # noqa: F401
from torchvision._standin import standin


def __getattr__(name: str) -> Any:
    return standin(__name__, name)
