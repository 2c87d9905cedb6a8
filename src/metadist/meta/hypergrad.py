"""Hypergradients of bilevel problems, exact across ranks.

The problem: an outer objective F(theta*(lam), lam) whose inner parameters solve
theta*(lam) = argmin_theta G(theta, lam). Notation below: H = d2G/dtheta2 (the inner
Hessian), gF_theta = dF/dtheta, gF_lam = dF/dlam (direct part), and the mixed product
M.v = d/dlam (dG/dtheta . v). Every method here has the signature

    method(outer_loss_fn, inner_loss_fn, params, hparams, config=None, *, grad_sync=None)
        -> tuple of tensors, one per hparam

with ``outer_loss_fn(params, hparams) -> F`` and ``inner_loss_fn(params, hparams) -> G``
(scalars), ``params`` a pytree (tuple, dict, ...) of tensors in the layout the loss functions
take, and ``hparams`` a tuple of tensors that require grad, or fast weights (another model's
``fast_weights().detach().requires_grad_()``: the loss functions get them as fast weights,
and under zero3/hsdp the results are their pieces' gradients, in order; fast_space.py).
The results carry no graph.
``params`` is the inner solution for ``neumann`` and ``cg``, the current inner iterate for
``darts`` and the starting point of the inner loop for ``unrolled``; the caller's tensors are
never modified and gain no ``.grad``. :func:`hypergradient` picks a registered method by name
(meta/methods.py; the built-in ones are registered in meta/builtin_methods.py).

Distributed exactness
---------------------
Under data parallelism each rank evaluates F and G on its slice of the global batch, and the
global objectives are the mean of the per-rank ones. Every data-dependent quantity a method
computes (gF_theta, gF_lam, each Hessian-vector product H.v, each mixed product M.v, each
inner gradient) goes through ``grad_sync`` (pass ``strategy.sync_grads``: a differentiable
mean over ranks), so each is the quantity of the *global* objective and the result equals the
single-process hypergradient on the whole batch, on every rank. Averaging per-rank
hypergradients instead is wrong for the implicit methods: the mean of inv(H_r) v_r is not
inv(H) v. Ranks must pass identical ``params`` and ``hparams``; data-dependent stopping (CG's
tolerance) then takes the same branch everywhere, because synced values are bitwise equal
on every rank. ``unrolled`` differentiates through the synced inner gradients (the backward
of ``sync_grads`` is again a collective), which is exact for equal per-rank shares, the
strategies' default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from metadist.meta import fast_space
from metadist.meta.directional import ReinforceConfig, SamaConfig
from metadist.meta.fast_space import Hparams, HparamsLike
from metadist.meta.methods import Solve, Vec, hypergradient_method
from metadist.meta.optim import GradSync
from metadist.meta.transforms import Transformation, apply_updates, sgd

LossFn = Callable[[Any, tuple[Tensor, ...]], Tensor]


@dataclasses.dataclass(frozen=True)
class UnrolledConfig:
    """Reverse mode through ``steps`` differentiable updates of ``optimizer`` from ``params``
    (memory grows with ``steps``; the result is the exact hypergradient of the truncated
    K-step problem, which tends to the implicit one as the inner loop converges)."""

    steps: int = 10
    optimizer: Transformation = dataclasses.field(default_factory=lambda: sgd(0.1))

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"UnrolledConfig(steps={self.steps}): unroll at least one step")


@dataclasses.dataclass(frozen=True)
class DartsConfig:
    """DARTS' second-order approximation from the current ``params`` w: one virtual step
    w' = w - xi * dG/dw(w), then gF_lam(w') - xi * M(w).v with v = dF/dw'(w') and the mixed
    product by a central finite difference, (dG/dlam(w + eps v) - dG/dlam(w - eps v)) /
    (2 eps), eps = r / |v|. It is the exact derivative of one unrolled SGD step up to the
    finite difference (exact when G is quadratic in w). ``first_order`` (or ``xi=0``) keeps
    gF_lam(w') only. Not Betty's "darts", which is gF - M.v at w with no virtual step and
    no xi: that is ``method="sama"`` with the default :class:`SamaConfig` here."""

    xi: float = 0.01
    r: float = 0.01
    first_order: bool = False

    def __post_init__(self) -> None:
        if self.xi < 0 or self.r <= 0:
            raise ValueError(f"DartsConfig needs xi >= 0 and r > 0, got xi={self.xi}, r={self.r}")


@dataclasses.dataclass(frozen=True)
class NeumannConfig:
    """Implicit function theorem with inv(H) ~ alpha * sum_{k=0..K} (I - alpha H)^k,
    K = ``iterations``. Converges for positive definite H when 0 < alpha < 2 / max eig(H);
    the error of inv(H) v is inv(H) (I - alpha H)^(K+1) v. ``iterations=0`` is the cheap
    inv(H) ~ alpha I approximation."""

    iterations: int = 10
    alpha: float = 0.01

    def __post_init__(self) -> None:
        if self.iterations < 0 or self.alpha <= 0:
            raise ValueError(f"NeumannConfig needs iterations >= 0 and alpha > 0, got "
                             f"iterations={self.iterations}, alpha={self.alpha}")


@dataclasses.dataclass(frozen=True)
class CGConfig:
    """Implicit function theorem with H x = gF_theta solved by conjugate gradient: at most
    ``iterations`` Hessian-vector products, stopping early once |residual| <= tol |gF_theta|.
    H must be positive definite at the inner solution (a direction of non-positive curvature
    raises); CG is exact after dim(theta) steps in exact arithmetic."""

    iterations: int = 10
    tol: float = 1e-10

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.tol < 0:
            raise ValueError(f"CGConfig needs iterations >= 1 and tol >= 0, got "
                             f"iterations={self.iterations}, tol={self.tol}")


HypergradConfig = (UnrolledConfig | DartsConfig | NeumannConfig | CGConfig | SamaConfig
                   | ReinforceConfig)


# ----- shared pieces -------------------------------------------------------------------------
def _prepare(params: Any, hparams: HparamsLike
             ) -> tuple[Vec, Any, Hparams]:
    lam = fast_space.hparams_of(hparams)
    leaves, spec = tree_flatten(params)
    if not leaves or not all(isinstance(p, Tensor) for p in leaves):
        raise TypeError("params must be a non-empty tuple/dict (pytree) of tensors")
    # Fresh leaves: the hypergradient is taken with respect to hparams only, and the caller's
    # tensors (e.g. a model's parameters) must not gain .grad or history here.
    theta = [p.detach().requires_grad_(True) for p in leaves]
    return theta, spec, lam


def _grad(out: Tensor, inputs: Sequence[Tensor], grad_outputs: Sequence[Tensor] | None = None,
          *, create_graph: bool = False, retain_graph: bool | None = None) -> tuple[Tensor, ...]:
    # Zeros for inputs out does not reach: every rank must sync the same tuple of tensors.
    return torch.autograd.grad(out, list(inputs), grad_outputs, create_graph=create_graph,
                               retain_graph=retain_graph, allow_unused=True,
                               materialize_grads=True)


def _scalar(value: Tensor, what: str) -> Tensor:
    if value.numel() != 1:
        raise ValueError(f"{what} must return a scalar, got shape {tuple(value.shape)}; reduce "
                         "it (e.g. .mean()) over this rank's samples")
    return value


def _dot(a: Vec, b: Vec) -> Tensor:
    with fast_space.shard_internals():  # made the sum over every shard below
        local = sum(((x * y).sum() for x, y in zip(a, b, strict=True)),
                    torch.zeros((), dtype=a[0].dtype, device=a[0].device))
    return fast_space.over_theta(local)  # over every shard where theta is shard pieces


def _outer_grads(outer_loss_fn: LossFn, theta: Vec, spec: Any, lam: Hparams,
                 grad_sync: GradSync | None) -> tuple[Vec, Vec]:
    """(gF_theta, gF_lam), synced together in one call."""
    f = _scalar(outer_loss_fn(tree_unflatten(theta, spec), lam.tree()), "outer_loss_fn")
    both = fast_space.sync_split(grad_sync, _grad(f, [*theta, *lam]), len(theta), spec, lam)
    return list(both[:len(theta)]), list(both[len(theta):])


# ----- implicit methods ------------------------------------------------------------------------
def implicit(outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
             hparams: HparamsLike, grad_sync: GradSync | None,
             solve: Solve) -> tuple[Tensor, ...]:
    """gF_lam - M.inv(H) gF_theta at the inner solution, ``solve(hvp, v) ~ inv(H) v``
    (``hvp(w)`` is the synced H.w): the frame :func:`neumann` and :func:`cg` fill in."""
    theta, spec, lam = _prepare(params, hparams)
    with fast_space.over(spec, lam):
        v, direct = _outer_grads(outer_loss_fn, theta, spec, lam, grad_sync)
        mixed = implicit_product(v, inner_loss_fn, theta, spec, lam, grad_sync, solve)
    return tuple((d - m).detach() for d, m in zip(direct, mixed, strict=True))


def implicit_product(v: Vec, inner_loss_fn: LossFn, theta: Vec, spec: Any,
                     lam: Hparams, grad_sync: GradSync | None, solve: Solve
                     ) -> tuple[Tensor, ...]:
    """M.solve(H, v) at ``theta`` (fresh leaves), every product synced."""
    with fast_space.over(spec, lam):
        inner = _scalar(inner_loss_fn(tree_unflatten(theta, spec), lam.tree()), "inner_loss_fn")
        # This rank's dG/dtheta with its graph: every H.v and M.v differentiate it again,
        # locally, and the products (not dG/dtheta) are synced, so each is the global one.
        g = _grad(inner, theta, create_graph=True)

        def hvp(w: Vec) -> Vec:
            return list(fast_space.sync_theta(grad_sync, _grad_of(g, theta, w), spec))

        return fast_space.sync_lam(grad_sync, _grad_of(g, lam, solve(hvp, v)), lam)


def _grad_of(g: Sequence[Tensor], inputs: Sequence[Tensor], w: Vec) -> tuple[Tensor, ...]:
    """(dg/dinputs)^T w, keeping g's graph for the next product."""
    live = [(gi, wi) for gi, wi in zip(g, w, strict=True) if gi.requires_grad]
    if not live:  # G is linear in theta: every second derivative is zero
        return tuple(torch.zeros_like(x) for x in inputs)
    out = torch.autograd.grad([gi for gi, _ in live], list(inputs), [wi for _, wi in live],
                              retain_graph=True, allow_unused=True, materialize_grads=True)
    return tuple(out)


def root_vjp(residual: Callable[..., Any], solution: Any, inputs: Sequence[Any],
             cotangent: Any, solve: Callable[[Callable[[Any], Any], Any], Any]
             ) -> tuple[Any, ...]:
    """The vector-Jacobian product of a root: ``x*(inputs)`` solves
    ``residual(x*, *inputs) = 0`` (an optimality condition, e.g. dG/dtheta = 0, whose
    Jacobians A = d residual/dx and B = d residual/d inputs are taken at the given
    ``solution``), and the result is ``cotangent^T dx*/d inputs = B^T u`` with
    ``A^T u = -cotangent`` solved by ``solve(matvec, b)`` (:func:`conjugate_gradient` and the
    Neumann series are such solvers; for A = H symmetric and B = M this is
    :func:`implicit_product`'s -M.inv(H) v). ``solution``, ``inputs`` and ``cotangent`` are
    pytrees of tensors, one gradient pytree per input is returned; the products are
    ``torch.func`` VJPs, so ``solve`` may itself differentiate ``matvec`` (normal equations,
    a materialised Jacobian). Unlike the methods above this is local: it syncs nothing."""
    vjp_solution = torch.func.vjp(lambda x: residual(x, *inputs), solution)[1]
    u = solve(lambda w: vjp_solution(w)[0], tree_map(torch.neg, cotangent))
    vjp_inputs = torch.func.vjp(lambda *xs: residual(solution, *xs), *inputs)[1]
    return tuple(vjp_inputs(u))


def neumann_solve(cfg: NeumannConfig) -> Solve:
    """inv(H) v ~ alpha * sum_{k=0..K} (I - alpha H)^k v."""
    def solve(hvp: Callable[[Vec], Vec], v: Vec) -> Vec:
        term, total = v, list(v)
        for _ in range(cfg.iterations):
            term = [t - cfg.alpha * h for t, h in zip(term, hvp(term), strict=True)]
            total = [s + t for s, t in zip(total, term, strict=True)]
        return [cfg.alpha * s for s in total]

    return solve


def conjugate_gradient(matvec: Callable[[Vec], Vec], b: Vec, x0: Vec | None = None, *,
                       maxiter: int, rtol: float = 0.0, atol: float = 0.0,
                       precond: Callable[[Vec], Vec] | None = None,
                       positive_definite: bool = False) -> list[Tensor]:
    """x with ``matvec(x) = b`` by (preconditioned) conjugate gradient over flat lists of
    tensors: from ``x0`` (zeros), at most ``maxiter`` products, stopping once
    ``<r, M r>`` (``<r, r>`` without a preconditioner) is at most
    ``max(rtol**2 <b, b>, atol**2)``. The step sizes stay tensors, so the result is in the
    autograd graph of ``b`` and of ``matvec``. ``positive_definite`` raises on a direction of
    non-positive curvature (:func:`cg_solve`'s check); without it the iteration runs on, as
    TorchOpt's ``linalg.cg`` does."""
    x = [torch.zeros_like(t) for t in b] if x0 is None else list(x0)
    r = list(b) if x0 is None else [bi - ai for bi, ai in zip(b, matvec(x), strict=True)]
    z = r if precond is None else list(precond(r))
    p = z
    gamma = _dot(r, z)
    stop = max(rtol**2 * _dot(b, b).item(), atol**2)
    for _ in range(maxiter):
        # Synced values are identical on every rank, so all ranks leave at the same step.
        residual = gamma if precond is None else _dot(r, r)
        if residual.item() <= stop:
            break
        hp = matvec(p)
        curvature = _dot(p, hp)
        if positive_definite and curvature.item() <= 0:
            raise ValueError("cg: the inner Hessian is not positive definite at params "
                             f"(p.Hp = {curvature.item():.3g}); pass the inner solution, "
                             "or use 'neumann' with a small alpha")
        a = gamma / curvature
        x = [xi + a * pi for xi, pi in zip(x, p, strict=True)]
        r = [ri - a * hi for ri, hi in zip(r, hp, strict=True)]
        z = r if precond is None else list(precond(r))
        gamma, gamma_old = _dot(r, z), gamma
        p = [zi + (gamma / gamma_old) * pi for zi, pi in zip(z, p, strict=True)]
    return x


def cg_solve(cfg: CGConfig) -> Solve:
    """inv(H) v by conjugate gradient, stopping at ``cfg.tol``; raises on non-positive
    curvature."""
    def solve(hvp: Callable[[Vec], Vec], v: Vec) -> Vec:
        return conjugate_gradient(hvp, v, maxiter=cfg.iterations, rtol=cfg.tol,
                                  positive_definite=True)

    return solve


def neumann(outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
            hparams: HparamsLike, config: NeumannConfig | None = None, *,
            grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
    """Implicit hypergradient at the inner solution ``params``, inv(H) by a truncated
    Neumann series (:class:`NeumannConfig`). ``grad_sync`` syncs gF_theta, gF_lam, every H.v
    and M.v, so the result is the global-batch hypergradient (module docstring)."""
    cfg = config or NeumannConfig()
    solve = neumann_solve(cfg)

    return implicit(outer_loss_fn, inner_loss_fn, params, hparams, grad_sync, solve)


def cg(outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
       hparams: HparamsLike, config: CGConfig | None = None, *,
       grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
    """Implicit hypergradient at the inner solution ``params``, inv(H) gF_theta by conjugate
    gradient (:class:`CGConfig`). ``grad_sync`` syncs gF_theta, gF_lam, every H.v and M.v, so
    the result is the global-batch hypergradient (module docstring)."""
    solve = cg_solve(config or CGConfig())
    return implicit(outer_loss_fn, inner_loss_fn, params, hparams, grad_sync, solve)


# ----- DARTS -------------------------------------------------------------------------------------
def darts(outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
          hparams: HparamsLike, config: DartsConfig | None = None, *,
          grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
    """DARTS' finite-difference hypergradient from the current inner ``params``
    (:class:`DartsConfig`). ``grad_sync`` syncs the virtual step's dG/dw, dF/dw', gF_lam and
    both dG/dlam(w +- eps v), so the result is the global-batch approximation."""
    cfg = config or DartsConfig()
    theta, spec, lam = _prepare(params, hparams)
    with fast_space.over(spec, lam):
        return _darts(outer_loss_fn, inner_loss_fn, theta, spec, lam, cfg, grad_sync)


def _darts(outer_loss_fn: LossFn, inner_loss_fn: LossFn, theta: Vec, spec: Any,
           lam: Hparams, cfg: DartsConfig, grad_sync: GradSync | None
           ) -> tuple[Tensor, ...]:
    inner = _scalar(inner_loss_fn(tree_unflatten(theta, spec), lam.tree()), "inner_loss_fn")
    step = fast_space.sync_theta(grad_sync, _grad(inner, theta), spec)
    virtual = [(p - cfg.xi * s).detach().requires_grad_(True)
               for p, s in zip(theta, step, strict=True)]
    v, direct = _outer_grads(outer_loss_fn, virtual, spec, lam, grad_sync)
    norm = _dot(v, v).sqrt()
    if cfg.first_order or cfg.xi == 0 or norm.item() == 0:
        return tuple(d.detach() for d in direct)
    eps = cfg.r / norm
    with torch.no_grad():
        plus = [p + eps * vi for p, vi in zip(theta, v, strict=True)]
        minus = [p - eps * vi for p, vi in zip(theta, v, strict=True)]
    g_plus = _grad(_scalar(inner_loss_fn(tree_unflatten(plus, spec), lam.tree()),
                           "inner_loss_fn"), lam)
    g_minus = _grad(_scalar(inner_loss_fn(tree_unflatten(minus, spec), lam.tree()),
                            "inner_loss_fn"), lam)
    both = fast_space.sync_lam(grad_sync, [*g_plus, *g_minus], lam)  # one collective
    n = len(lam)
    return tuple((d - cfg.xi * (gp - gm) / (2 * eps)).detach()
                 for d, gp, gm in zip(direct, both[:n], both[n:], strict=True))


# ----- unrolled ----------------------------------------------------------------------------------
def unrolled(outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
             hparams: HparamsLike, config: UnrolledConfig | None = None, *,
             grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
    """Reverse-mode hypergradient through ``config.steps`` differentiable inner updates from
    the initial ``params`` (:class:`UnrolledConfig`). ``grad_sync`` syncs every inner gradient
    (differentiably) and the final dF/dlam, so the result is the global-batch hypergradient."""
    cfg = config or UnrolledConfig()
    theta, spec, lam = _prepare(params, hparams)
    with fast_space.over(spec, lam):
        tree = tree_unflatten(theta, spec)
        state = cfg.optimizer.init(tree)
        for _ in range(cfg.steps):
            inner = _scalar(inner_loss_fn(tree, lam.tree()), "inner_loss_fn")
            grads = fast_space.sync_theta(
                grad_sync, _grad(inner, tree_flatten(tree)[0], create_graph=True), spec)
            updates, state = cfg.optimizer.update(tree_unflatten(list(grads), spec), state,
                                                  params=tree)
            tree = apply_updates(tree, updates)
        outer = _scalar(outer_loss_fn(tree, lam.tree()), "outer_loss_fn")
        return tuple(g.detach() for g in fast_space.sync_lam(grad_sync, _grad(outer, lam), lam))


# ----- by name ----------------------------------------------------------------------------------
def hypergradient(method: str, outer_loss_fn: LossFn, inner_loss_fn: LossFn, params: Any,
                  hparams: HparamsLike, config: HypergradConfig | None = None, *,
                  grad_sync: GradSync | None = None) -> tuple[Tensor, ...]:
    """The hypergradient of a registered method by name (:func:`unrolled`, :func:`darts`,
    :func:`neumann`, :func:`cg`, :func:`~metadist.meta.directional.sama`,
    :func:`~metadist.meta.directional.reinforce`, or one added with
    :func:`~metadist.meta.methods.register_hypergradient`); ``config`` must be that
    method's config class (None: its defaults)."""
    return hypergradient_method(method).hypergradient(
        outer_loss_fn, inner_loss_fn, params, hparams, config, grad_sync=grad_sync)
