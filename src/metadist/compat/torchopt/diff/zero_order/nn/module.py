"""TorchOpt's ``ZeroOrderGradientModule``: a module whose ``forward`` (a scalar) gets a
zero-order gradient estimate with respect to its parameters, perturbed with its own
``sample``; ``class M(ZeroOrderGradientModule, method=..., num_samples=..., sigma=...)``
picks the estimator (:func:`~metadist.compat.torchopt.diff.zero_order.zero_order`)."""

from __future__ import annotations

import abc
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from metadist.compat.torchopt.diff.zero_order.decorator import Method, zero_order
from metadist.compat.torchopt.nn.stateless import reparametrize
from metadist.compat.torchopt.typing import Numeric, Samplable

__all__ = ["ZeroOrderGradientModule"]


def enable_zero_order_gradients(cls: type[ZeroOrderGradientModule], method: Method = "naive",
                                num_samples: int = 1, sigma: float = 1.0
                                ) -> type[ZeroOrderGradientModule]:
    """Make ``cls.forward`` estimate its gradient by zero-order sampling."""
    cls_forward = cls.forward
    if getattr(cls_forward, "__zero_order_gradients_enabled__", False):
        raise TypeError(
            "Zero-order gradient estimation is already enabled for the `forward` method.")

    @functools.wraps(cls_forward)
    def wrapped(self: ZeroOrderGradientModule, *input: Any, **kwargs: Any) -> torch.Tensor:
        named = tuple(self.named_parameters())
        if not named:
            raise RuntimeError("The module has no parameters.")
        names, flat = zip(*named, strict=True)

        @zero_order(self.sample, argnums=0, method=method, num_samples=num_samples,
                    sigma=sigma)
        def forward_fn(__flat_params: tuple[torch.Tensor, ...], *input: Any,
                       **kwargs: Any) -> torch.Tensor:
            with reparametrize(self, zip(names, __flat_params, strict=True)):
                return cls_forward(self, *input, **kwargs)

        return forward_fn(flat, *input, **kwargs)

    wrapped.__zero_order_gradients_enabled__ = True  # type: ignore[attr-defined]
    cls.forward = wrapped  # type: ignore[method-assign]
    return cls


class ZeroOrderGradientModule(nn.Module, Samplable):
    """The base class of modules with zero-order gradients (module docstring)."""

    def __init_subclass__(cls, method: Method = "naive", num_samples: int = 1,
                          sigma: float = 1.0) -> None:
        super().__init_subclass__()
        enable_zero_order_gradients(cls, method=method, num_samples=num_samples, sigma=sigma)

    @abc.abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The forward pass: a scalar."""
        raise NotImplementedError(f"{type(self).__name__} must define forward(), returning "
                                  "the scalar whose gradient is estimated")

    @abc.abstractmethod
    def sample(self, sample_shape: torch.Size = torch.Size()  # noqa: B008
               ) -> torch.Tensor | Sequence[Numeric]:
        """A ``sample_shape`` batch of perturbations."""
        raise NotImplementedError(f"{type(self).__name__} must define sample(sample_shape), "
                                  "returning a batch of perturbations")
