"""TorchOpt's ``torchopt.typing``: the type aliases its signatures use (with optree's
``PyTree`` generics where optree is installed; plain aliases otherwise)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol, TypeAlias, TypeVar, Union, runtime_checkable

import torch
from torch import Tensor
from torch.distributions import Distribution
from torch.futures import Future

from metadist.compat.torchopt.base import (
    ChainedGradientTransformation,
    EmptyState,
    GradientTransformation,
    UninitializedState,
)

__all__ = ["ChainedGradientTransformation", "Device", "Distribution", "EmptyState", "Future",
           "GradientTransformation", "LinearSolver", "ListOfOptionalTensors", "ListOfTensors",
           "ModuleTensorContainers", "Numeric", "OptState", "OptionalTensor",
           "OptionalTensorOrOptionalTensors", "OptionalTensorTree", "Params", "PyTree",
           "Samplable", "SampleFunc", "Scalar", "ScalarOrSchedule", "Schedule",
           "SequenceOfOptionalTensors", "SequenceOfTensors", "Size", "Tensor",
           "TensorContainer", "TensorOrTensors", "TensorTree", "TupleOfOptionalTensors",
           "TupleOfTensors", "UninitializedState", "Updates"]

T = TypeVar("T")
try:
    from optree.typing import PyTree, PyTreeTypeVar

    TensorTree: Any = PyTreeTypeVar("TensorTree", Tensor)
    OptionalTensorTree: Any = PyTreeTypeVar("OptionalTensorTree", Optional[Tensor])  # noqa: UP045
except ImportError:  # pragma: no cover - optree is optional
    PyTree = Any
    TensorTree = Any
    OptionalTensorTree = Any

Device: TypeAlias = Union[torch.device, str, int]  # noqa: UP007
Scalar: TypeAlias = Union[float, int, bool]  # noqa: UP007
Numeric: TypeAlias = Union[Tensor, Scalar]  # noqa: UP007
Schedule: TypeAlias = Callable[[Numeric], Numeric]
ScalarOrSchedule: TypeAlias = Union[float, Schedule]  # noqa: UP007
OptionalTensor = Optional[Tensor]  # noqa: UP045
ListOfTensors = list[Tensor]
TupleOfTensors = tuple[Tensor, ...]
SequenceOfTensors = Sequence[Tensor]
TensorOrTensors = Union[Tensor, SequenceOfTensors]  # noqa: UP007
ListOfOptionalTensors = list[OptionalTensor]
TupleOfOptionalTensors = tuple[OptionalTensor, ...]
SequenceOfOptionalTensors = Sequence[OptionalTensor]
OptionalTensorOrOptionalTensors = Union[OptionalTensor, SequenceOfOptionalTensors]  # noqa: UP007
TensorContainer = dict[str, Optional[Tensor]]  # noqa: UP045
ModuleTensorContainers = tuple[TensorContainer, ...]
Params: TypeAlias = Any
Updates: TypeAlias = Any
OptState: TypeAlias = Any
LinearSolver: TypeAlias = Callable[[Callable[[Any], Any], Any], Any]
Size = torch.Size
SampleFunc: TypeAlias = Callable[[Size], Union[Tensor, Sequence[Numeric]]]  # noqa: UP007

if torch.distributed.rpc.is_available():
    from torch.distributed.rpc import RRef

    __all__ += ["RRef"]


@runtime_checkable
class Samplable(Protocol):
    """Anything with ``sample(sample_shape)`` (torch distributions are registered)."""

    @abc.abstractmethod
    def sample(self, sample_shape: Size = Size()) -> Tensor | Sequence[Numeric]:  # noqa: B008
        raise NotImplementedError(f"{type(self).__name__} must define "
                                  "sample(sample_shape)")


Samplable.register(Distribution)
