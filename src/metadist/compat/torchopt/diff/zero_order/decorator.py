"""TorchOpt's ``torchopt.diff.zero_order``: gradients estimated from function values.

``zero_order(distribution, method, argnums, num_samples, sigma)(fn)`` returns ``fn`` (a
scalar function of positional arguments) whose backward pass, instead of differentiating
``fn``, perturbs the arguments at ``argnums`` by ``sigma * z`` with
``z = distribution.sample(sample_shape=p.shape)`` (one draw per tensor, ``num_samples``
times) and averages ``w(z) * z`` with, for an incoming gradient ``g``:

* ``'naive'``: ``w = g * f(p + sigma z) / sigma``;
* ``'antithetic'``: ``w = g * (f(p + sigma z) - f(p - sigma z)) * 0.5 / sigma``;
* ``'forward'``: TorchOpt 0.7.3's arithmetic, kept for a TorchOpt program's numbers:
  ``w = g * d * sigma`` with ``d = f(p + sigma z) - b`` and ``b`` the previous sample's ``d``
  (``f(p)`` for the first), which is the forward difference ``(f(p + sigma z) - f(p)) /
  sigma`` only for one sample and ``sigma = 1``.

The draws come from the caller's random state in TorchOpt's order (sample by sample, tensor
by tensor), so a seeded program gets TorchOpt's numbers. Keyword arguments are not accepted,
as in TorchOpt.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch.utils import _pytree as tp

from metadist.compat.torchopt import _tree
from metadist.compat.torchopt.typing import Numeric, Samplable, SampleFunc

__all__ = ["Method", "WrappedSamplable", "zero_order"]

Method = Literal["naive", "forward", "antithetic"]
ScalarFn = Callable[..., torch.Tensor]
_TENSOR = object()  # where a saved tensor goes back into the arguments


class WrappedSamplable(Samplable):
    """A sample function as a :class:`~metadist.compat.torchopt.typing.Samplable`."""

    def __init__(self, sample_fn: SampleFunc) -> None:
        self.sample_fn = sample_fn

    def sample(self, sample_shape: torch.Size = torch.Size()  # noqa: B008
               ) -> torch.Tensor | Sequence[Numeric]:
        return self.sample_fn(sample_shape)


def _estimate(method: Method, f: Callable[[list[Any]], torch.Tensor], flat: Sequence[Any],
              value: torch.Tensor, g: torch.Tensor, distribution: Samplable,
              num_samples: int, sigma: float) -> list[Any]:
    """The averaged estimate, one entry per tensor of ``flat`` (module docstring)."""
    total: list[Any] = [0.0] * len(flat)
    baseline = value
    for _ in range(num_samples):
        z: list[Any] = [distribution.sample(sample_shape=p.shape) for p in flat]
        plus = f([p.add(n, alpha=sigma) for p, n in zip(flat, z, strict=True)])
        if method == "naive":
            weight = g.mul(plus).mul_(1 / sigma)
        elif method == "forward":
            baseline = plus - baseline
            weight = g.mul(baseline).div_(1.0 / sigma)
        else:
            minus = f([torch.sub(p, n, alpha=sigma) for p, n in zip(flat, z, strict=True)])
            weight = g.mul(plus - minus).mul_(0.5 / sigma)
        for i, n in enumerate(z):
            total[i] += weight * n
    for i in range(len(total)):
        total[i] /= num_samples
    return total


def _estimator(fn: ScalarFn, distribution: Samplable, argnums: tuple[int, ...],
               num_samples: int, sigma: float, method: Method) -> ScalarFn:
    @functools.wraps(fn)
    def apply(*args: Any) -> torch.Tensor:
        flat = tp.tree_leaves([args[i] for i in argnums])
        setup = (fn, args, distribution, argnums, num_samples, sigma, method)
        out: torch.Tensor = _ZeroOrder.apply(setup, *flat)
        return out

    return apply


class _ZeroOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, setup: tuple[Any, ...], *flat: torch.Tensor) -> torch.Tensor:
        fn, args = setup[0], setup[1]
        value = fn(*args)
        if not isinstance(value, torch.Tensor):
            raise RuntimeError("`output` must be a tensor.")
        if value.ndim != 0:
            raise RuntimeError("`output` must be a scalar tensor.")
        leaves, spec = _tree.flatten(list(args))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        ctx.setup, ctx.spec, ctx.n_flat = setup, spec, len(flat)
        ctx.others = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        ctx.save_for_backward(*flat, *tensors, value)
        return value

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        fn, _, distribution, argnums, num_samples, sigma, method = ctx.setup
        saved = ctx.saved_tensors
        flat, tensors, value = saved[:ctx.n_flat], iter(saved[ctx.n_flat:-1]), saved[-1]
        args = _tree.unflatten(ctx.spec, [next(tensors) if x is _TENSOR else x
                                          for x in ctx.others])
        diff_spec = tp.tree_structure([args[i] for i in argnums])

        def f(noisy: list[Any]) -> torch.Tensor:
            for i, p in zip(argnums, tp.tree_unflatten(noisy, diff_spec), strict=True):
                args[i] = p
            out: torch.Tensor = fn(*args)
            return out

        grads = _estimate(method, f, flat, value, grad_outputs[0], distribution, num_samples,
                          sigma)
        return (None, *grads)


def zero_order(distribution: SampleFunc | Samplable, method: Method = "naive",
               argnums: int | tuple[int, ...] = (0,), num_samples: int = 1,
               sigma: float = 1.0) -> Callable[[ScalarFn], ScalarFn]:
    """A decorator that gives a scalar function a zero-order gradient estimate (module
    docstring); ``distribution`` is a :class:`Samplable` (``torch.distributions``) or a
    function of the sample shape, and should be sphere symmetric."""
    assert method in ("naive", "forward", "antithetic")
    if isinstance(argnums, int):
        argnums = (argnums,)
    if not isinstance(distribution, Samplable):
        if not callable(distribution):
            raise TypeError("`distribution` must be a callable or an instance of `Samplable`.")
        distribution = WrappedSamplable(distribution)
    return functools.partial(_estimator, distribution=distribution, argnums=argnums,
                             num_samples=num_samples, sigma=sigma, method=method)
