"""The built-in hypergradient methods, registered in the order errors list them. The
mathematics lives in meta/hypergrad.py (unrolled, DARTS, Neumann, CG) and meta/directional.py
(SAMA, REINFORCE); each class here says how the meta layer uses one of them."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from metadist.meta import fast_space
from metadist.meta.bilevel import sama_scale
from metadist.meta.directional import (
    ReinforceConfig,
    SamaConfig,
    mixed_fd,
    reinforce,
    reinforce_product,
    sama,
    scaled,
)
from metadist.meta.fast_space import HparamsLike
from metadist.meta.hypergrad import (
    CGConfig,
    DartsConfig,
    NeumannConfig,
    UnrolledConfig,
    _prepare,
    cg,
    cg_solve,
    darts,
    implicit_product,
    neumann,
    neumann_solve,
    unrolled,
)
from metadist.meta.methods import (
    HypergradientMethod,
    LossFn,
    Solve,
    available_hypergradients,
    register_hypergradient,
)
from metadist.meta.optim import GradSync
from metadist.meta.transforms import sgd

if TYPE_CHECKING:
    from metadist.meta.problem import Problem


def _lr(problem: Problem) -> float:
    return float(problem.optimizer.param_groups[0]["lr"])


@register_hypergradient("unrolled")
class Unrolled(HypergradientMethod):
    """Reverse mode through the lower problem's last ``unroll_steps`` steps, replayed."""

    Config = UnrolledConfig
    compute = staticmethod(unrolled)
    replays_steps = True

    def check(self, config: Any, unroll_steps: int) -> None:
        super().check(config, unroll_steps)
        if isinstance(config, UnrolledConfig) and config.steps != unroll_steps:
            raise ValueError(f"UnrolledConfig(steps={config.steps}) differs from "
                             f"unroll_steps={unroll_steps}: the engine replays exactly the "
                             "unroll window; set both to the same number")

    def for_problem(self, lower: Problem, upper: Problem) -> UnrolledConfig:
        if not lower._record:
            raise RuntimeError(
                f"{upper.name!r} steps before {lower.name!r} took a step to unroll; "
                f"list {upper.name!r} in dependencies['l2u'][{lower.name!r}]")
        given = lower.config.hypergrad
        opt = given.optimizer if isinstance(given, UnrolledConfig) else sgd(_lr(lower))
        return UnrolledConfig(steps=len(lower._record), optimizer=opt)


@register_hypergradient("darts")
class Darts(HypergradientMethod):
    """DARTS' finite-difference approximation from the current inner parameters."""

    Config = DartsConfig
    compute = staticmethod(darts)

    def response(self, v: Sequence[Tensor], inner_loss_fn: LossFn, params: Any,
                 hparams: HparamsLike, config: Any = None, *,
                 grad_sync: GradSync | None = None, solve: Solve | None = None
                 ) -> tuple[Tensor, ...]:
        theta, spec, lam = _prepare(params, hparams)
        cfg = config if isinstance(config, DartsConfig) else DartsConfig()
        if cfg.first_order or cfg.xi == 0:
            return tuple(t.new_zeros(t.shape) for t in lam)
        return tuple(mixed_fd(inner_loss_fn, theta, spec, lam, [t.detach() for t in v], cfg.r,
                              grad_sync, sign=-cfg.xi))

    def for_problem(self, lower: Problem, upper: Problem) -> DartsConfig:
        given = lower.config.hypergrad
        return given if isinstance(given, DartsConfig) else DartsConfig(xi=_lr(lower))


class _Implicit(HypergradientMethod):
    """Implicit function theorem at the inner solution; subclasses choose the solve."""

    @abstractmethod
    def _solve(self, config: Any) -> Solve:
        """The inverse-Hessian solve ``config`` describes."""

    def response(self, v: Sequence[Tensor], inner_loss_fn: LossFn, params: Any,
                 hparams: HparamsLike, config: Any = None, *,
                 grad_sync: GradSync | None = None, solve: Solve | None = None
                 ) -> tuple[Tensor, ...]:
        theta, spec, lam = _prepare(params, hparams)
        m = implicit_product([t.detach() for t in v], inner_loss_fn, theta, spec, lam,
                             grad_sync, solve or self._solve(config))
        return tuple(-x.detach() for x in m)


@register_hypergradient("neumann")
class Neumann(_Implicit):
    """inv(H) by a truncated Neumann series."""

    Config = NeumannConfig
    compute = staticmethod(neumann)

    def _solve(self, config: Any) -> Solve:
        return neumann_solve(config if isinstance(config, NeumannConfig) else NeumannConfig())

    def for_problem(self, lower: Problem, upper: Problem) -> NeumannConfig:
        given = lower.config.hypergrad
        return given if isinstance(given, NeumannConfig) else NeumannConfig(alpha=_lr(lower))


@register_hypergradient("cg")
class ConjugateGradient(_Implicit):
    """inv(H) v by conjugate gradient."""

    Config = CGConfig
    compute = staticmethod(cg)

    def _solve(self, config: Any) -> Solve:
        return cg_solve(config if isinstance(config, CGConfig) else CGConfig())


@register_hypergradient("sama")
class Sama(HypergradientMethod):
    """gF - M.(P v) at the current parameters, P the optimizer's update derivative."""

    Config = SamaConfig
    compute = staticmethod(sama)
    keeps_last_grads = True

    def response(self, v: Sequence[Tensor], inner_loss_fn: LossFn, params: Any,
                 hparams: HparamsLike, config: Any = None, *,
                 grad_sync: GradSync | None = None, solve: Solve | None = None
                 ) -> tuple[Tensor, ...]:
        theta, spec, lam = _prepare(params, hparams)
        cfg = config if isinstance(config, SamaConfig) else SamaConfig()
        w = scaled([t.detach() for t in v], fast_space.laid_out(cfg.scale, spec))
        return tuple(mixed_fd(inner_loss_fn, theta, spec, lam, w, cfg.r, grad_sync, sign=-1.0))

    def for_problem(self, lower: Problem, upper: Problem) -> SamaConfig:
        given = lower.config.hypergrad
        if isinstance(given, SamaConfig) and given.scale is not None:
            return given
        r = given.r if isinstance(given, SamaConfig) else SamaConfig().r
        return SamaConfig(r=r, scale=sama_scale(lower))


@register_hypergradient("reinforce")
class Reinforce(HypergradientMethod):
    """The score-function estimator: the inner loss returns per-sample terms."""

    Config = ReinforceConfig
    compute = staticmethod(reinforce)
    per_sample_inner = True

    def response(self, v: Sequence[Tensor], inner_loss_fn: LossFn, params: Any,
                 hparams: HparamsLike, config: Any = None, *,
                 grad_sync: GradSync | None = None, solve: Solve | None = None
                 ) -> tuple[Tensor, ...]:
        theta, spec, lam = _prepare(params, hparams)
        cfg = config if isinstance(config, ReinforceConfig) else ReinforceConfig()
        score = reinforce_product(inner_loss_fn, theta, spec, lam, [t.detach() for t in v],
                                  cfg, grad_sync)
        return tuple(-x.detach() for x in score)

    def for_problem(self, lower: Problem, upper: Problem) -> ReinforceConfig:
        given = lower.config.hypergrad
        return given if isinstance(given, ReinforceConfig) else ReinforceConfig(xi=_lr(lower))


#: The built-in methods' names (:func:`~metadist.meta.methods.available_hypergradients` lists
#: every registered one).
METHODS = tuple(available_hypergradients())
