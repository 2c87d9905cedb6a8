"""The hypergradient method registry behind ``ProblemConfig(method=...)`` and
:func:`metadist.meta.hypergradient` (as ``metadist.strategy(name)`` has its strategy registry).

A method is one class that carries everything the meta layer asks of it: its config class
(checked by ``ProblemConfig``), the hypergradient, the response product a multi-level path
carries through it (by default: the hypergradient of the linear loss <theta, v>), and the
config the engine derives for it from a lower problem. Adding a method is one file with a
registered subclass (the built-in ones are in meta/builtin_methods.py)::

    @register_hypergradient("mine")
    class Mine(HypergradientMethod):
        Config = MineConfig
        # mine(outer_loss_fn, inner_loss_fn, params, hparams, config, *, grad_sync)
        compute = staticmethod(mine)
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from torch import Tensor

from metadist.meta.fast_space import HparamsLike
from metadist.meta.optim import GradSync

if TYPE_CHECKING:
    from metadist.meta.problem import Problem

LossFn = Callable[[Any, tuple[Tensor, ...]], Any]
Vec = list[Tensor]
Solve = Callable[[Callable[[Vec], Vec], Vec], Vec]  # solve(hvp, v) ~ inv(H) v


class HypergradientMethod(ABC):
    """One way to differentiate an upper loss through a lower problem's response."""

    name: ClassVar[str] = "?"
    #: The method's frozen config dataclass (``ProblemConfig(hypergrad=...)``).
    Config: ClassVar[type[Any]]
    #: The inner loss returns per-sample terms (a dict with ``losses`` and ``log_prob``).
    per_sample_inner: ClassVar[bool] = False
    #: Differentiates through the lower problem's recorded steps from the start of its
    #: unroll window (the engine records and replays them) instead of its current parameters.
    replays_steps: ClassVar[bool] = False
    #: Needs each step's gradient kept in the optimizer state (``last_grad``) after the step.
    keeps_last_grads: ClassVar[bool] = False

    def config_of(self, config: Any) -> Any:
        """``config`` checked to be this method's (None: the method's defaults)."""
        if config is not None and not isinstance(config, self.Config):
            name = self.Config.__name__
            raise TypeError(f"method {self.name!r} takes a {name}, got "
                            f"{type(config).__name__}; pass {name}(...) or None")
        return config

    def check(self, config: Any, unroll_steps: int) -> None:
        """Raise if ``ProblemConfig(method=self.name, hypergrad=config, unroll_steps=...)``
        cannot mean what it says."""
        self.config_of(config)

    #: The hypergradient itself (meta/hypergrad.py, meta/directional.py):
    #: ``compute(outer_loss_fn, inner_loss_fn, params, hparams, config, *, grad_sync)``.
    #: A method either names it here (``compute = staticmethod(fn)``) or overrides
    #: :meth:`hypergradient`.
    compute: ClassVar[Callable[..., tuple[Tensor, ...]]]

    def hypergradient(self, outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
                      hparams: HparamsLike, config: Any = None, *,
                      grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
        """d outer / d hparams through the inner problem, with this method's config."""
        return self.compute(outer_loss_fn, inner_loss_fn, params, hparams,
                            self.config_of(config), grad_sync=grad_sync)

    def response(self, v: Sequence[Tensor], inner_loss_fn: LossFn, params: Any,
                 hparams: HparamsLike, config: Any = None, *,
                 grad_sync: GradSync | None = None, solve: Solve | None = None
                 ) -> tuple[Tensor, ...]:
        """-M.A.v (see meta/response.py): by default the hypergradient of the linear outer
        loss <theta, v>, which is exactly that product. ``solve`` replaces an implicit
        method's inverse-Hessian solve."""
        return self.hypergradient(_linear([t.detach() for t in v]), inner_loss_fn, params,
                                  hparams, config, grad_sync=grad_sync)

    def for_problem(self, lower: Problem, upper: Problem) -> Any:
        """The config the engine uses when ``upper`` differentiates through ``lower``:
        ``lower.config.hypergrad``, else defaults (some from ``lower``'s optimizer)."""
        return lower.config.hypergrad or self.Config()


def _linear(v: Vec) -> LossFn:
    def outer(theta: Any, lam: tuple[Tensor, ...]) -> Tensor:
        flat = list(theta.values()) if isinstance(theta, dict) else list(theta)
        total: Tensor = (flat[0] * v[0]).sum()
        for t, w in zip(flat[1:], v[1:], strict=True):
            total = total + (t * w).sum()
        return total

    return outer


_REGISTRY: dict[str, HypergradientMethod] = {}
_ALIASES: dict[str, str] = {}
M = TypeVar("M", bound=type[HypergradientMethod])


def register_hypergradient(name: str, *aliases: str) -> Callable[[M], M]:
    """Class decorator: make a method available as ``ProblemConfig(method=name)`` and
    ``hypergradient(name, ...)`` (and under ``aliases``)."""
    def decorate(cls: M) -> M:
        taken = [n for n in (name, *aliases) if n in _REGISTRY or n in _ALIASES]
        if taken:
            raise ValueError(f"hypergradient method name(s) {', '.join(map(repr, taken))} "
                             "are already registered; choose another name")
        cls.name = name
        _REGISTRY[name] = cls()
        for alias in aliases:
            _ALIASES[alias] = name
        return cls

    return decorate


def available_hypergradients() -> list[str]:
    """Every registered method name and alias, in registration order."""
    return [*_REGISTRY, *_ALIASES]


def hypergradient_method(name: str) -> HypergradientMethod:
    """The registered method called ``name``; raises listing the registered ones."""
    found = _REGISTRY.get(_ALIASES.get(name, name))
    if found is None:
        raise ValueError(f"hypergradient method {name!r} is not known; choose one of: "
                         f"{', '.join(available_hypergradients())}")
    return found
