"""Differentiable optimisers bound to a module, for inner loops (MAML and friends).

``MetaSGD(net, lr=0.1).step(loss)`` differentiates ``loss`` with respect to the module's
current trainable parameters with ``create_graph=True`` and rebinds the module's parameters
to the updated tensors, so the next forward uses them and an outer backward flows through
every inner step (and through the optimiser state) to the original leaves. The maths is the
functional form in :mod:`metadist.meta.transforms`; this class only binds it to a module.

Under a strategy, inner loops stay local to each rank (metadist's semantics: only
accumulation into ``.grad`` syncs). Bind the optimiser to a per-task
``module_clone(model, by="copy")`` under every strategy (under zero3/hsdp the clone holds the
full parameters, differentiable into the shards), or under ddp, zero1 and zero2 to ``model``
itself, restoring it with ``recover_state_dict`` before ``optimizer.step()``. Pass
``grad_sync=strategy.sync_grads`` when the inner problem itself is global (e.g. unrolled
bilevel optimisation over the whole, rank-split, training batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from metadist.meta.adaptive import adadelta, adagrad, adamax, radam, rmsprop
from metadist.meta.modules import ParamUse, trainable_slots, unwrap
from metadist.meta.transforms import (
    Mask,
    Scalar,
    Transformation,
    adam,
    adamw,
    apply_updates,
    sgd,
)
from metadist.strategies.bind import rebind_parameters

GradSync = Callable[[tuple[Tensor, ...]], tuple[Tensor, ...]]


class MetaOptimizer:
    """Steps ``module``'s trainable parameters with ``transform``, differentiably.

    The set of parameters is fixed at construction (those with ``requires_grad``); their
    current tensors are read from the module at every step, so a
    :func:`~metadist.meta.recover_state_dict` in between is seen. A parameter that ``loss``
    does not reach gets a zero gradient (weight decay and momentum still apply to it).

    ``create_graph=False`` drops second-order terms (first-order MAML): gradients are
    detached, the new parameters still depend on the old ones. ``grad_sync`` (e.g.
    ``strategy.sync_grads``) is applied to every inner gradient before the update.
    """

    def __init__(self, module: nn.Module, transform: Transformation, *,
                 create_graph: bool = True, grad_sync: GradSync | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__} binds to an nn.Module, got "
                            f"{type(module).__name__}; for tensors use the functional form "
                            "(metadist.meta.sgd, adam, rmsprop, chain, ...)")
        self.module = unwrap(module)  # a strategy's wrapper binds the user's module
        self._root = module  # what the names below are relative to
        self.transform = transform
        self.create_graph = create_graph
        self.grad_sync = grad_sync
        self._slots: list[tuple[str, list[ParamUse]]] = trainable_slots(module)
        if not self._slots:
            raise ValueError(f"{type(module).__name__} has no parameter with requires_grad=True; "
                             "a meta-optimiser needs trainable parameters to step")
        self.state: Any = transform.init(self.params)

    @property
    def params(self) -> dict[str, Tensor]:
        """The current tensor of every stepped parameter, by its (first) qualified name."""
        out: dict[str, Tensor] = {}
        for name, ((owner, local), *_) in self._slots:
            tensor = owner._parameters[local]
            if tensor is None:
                raise ValueError(f"parameter {name!r} was set to None after {type(self).__name__} "
                                 "was built; build the meta-optimiser after changing the module")
            out[name] = tensor
        return out

    def step(self, loss: Tensor) -> None:
        """One differentiable update from ``loss`` (a scalar computed with the current
        parameters); the module's parameters are rebound to the updated tensors."""
        params = self.params
        if loss.numel() != 1:
            raise ValueError(f"step(loss) needs a scalar loss, got shape {tuple(loss.shape)}; "
                             "reduce it first (e.g. loss.mean())")
        if not loss.requires_grad:
            raise ValueError("step(loss): the loss does not require grad, so it cannot depend "
                             "on the module's parameters; compute it outside torch.no_grad() "
                             "with the module's current parameters")
        tensors = list(params.values())
        grads = torch.autograd.grad(loss, tensors, create_graph=self.create_graph,
                                    allow_unused=True, materialize_grads=True)
        if self.grad_sync is not None:
            grads = self.grad_sync(tuple(grads))
        updates, self.state = self.transform.update(
            dict(zip(params, grads, strict=True)), self.state, params=params)
        # Into the module's parameter entries (every use of a tied weight): see
        # metadist.meta.modules for why.
        rebind_parameters(self._root, apply_updates(params, updates))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear (gradients are returned, never accumulated); kept so code written
        for ``torch.optim`` optimisers runs unchanged."""

    def state_dict(self) -> dict[str, Any]:
        """``{"state": state}``; the tensors are references (still in the graph). Steps never
        modify a state in place, so an earlier ``state_dict()`` stays a valid snapshot."""
        return {"state": self.state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Adopt a state from :meth:`state_dict` of an optimiser of the same kind and
        parameters (tensors are taken as they are, not copied)."""
        if "state" not in state_dict:
            raise KeyError("load_state_dict needs the {'state': ...} mapping from "
                           f"state_dict(); got keys {sorted(state_dict)}")
        state = state_dict["state"]
        want, got = tree_flatten(self.state)[1], tree_flatten(state)[1]
        if type(state) is not type(self.state) or want != got:
            raise ValueError(f"this state ({type(state).__name__}) does not fit this optimiser "
                             f"({type(self).__name__} over {len(self._slots)} parameters); "
                             "load a state_dict() of an optimiser of the same kind bound to "
                             "a module with the same parameters")
        self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transform!r}, parameters={len(self._slots)})"


class MetaSGD(MetaOptimizer):
    """Differentiable ``torch.optim.SGD`` bound to ``module`` (``lr`` may be a tensor)."""

    def __init__(self, module: nn.Module, lr: Scalar, momentum: float = 0.0, *,
                 dampening: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 maximize: bool = False, create_graph: bool = True,
                 grad_sync: GradSync | None = None) -> None:
        # Keyword-only after momentum: TorchOpt's MetaSGD takes weight_decay 3rd, torch's
        # SGD dampening; positional calls meaning either must fail, not pick another option.
        super().__init__(module, sgd(lr, momentum, dampening=dampening, nesterov=nesterov,
                                     weight_decay=weight_decay, maximize=maximize),
                         create_graph=create_graph, grad_sync=grad_sync)


class MetaAdam(MetaOptimizer):
    """Differentiable ``torch.optim.Adam`` bound to ``module`` (``lr`` may be a tensor);
    ``eps_root``/``moment_requires_grad``: see :class:`metadist.meta.transforms.Adam`."""

    def __init__(self, module: nn.Module, lr: Scalar = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, maximize: bool = False, *, eps_root: float = 0.0,
                 moment_requires_grad: bool = False, create_graph: bool = True,
                 grad_sync: GradSync | None = None) -> None:
        super().__init__(module, adam(lr, betas, eps, weight_decay, maximize, eps_root=eps_root,
                                      moment_requires_grad=moment_requires_grad),
                         create_graph=create_graph, grad_sync=grad_sync)


class MetaAdamW(MetaOptimizer):
    """Differentiable ``torch.optim.AdamW`` bound to ``module`` (``lr`` may be a tensor);
    ``mask`` limits weight decay (bools keyed like :attr:`params`, or a callable of them)."""

    def __init__(self, module: nn.Module, lr: Scalar = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, maximize: bool = False, *, eps_root: float = 0.0,
                 moment_requires_grad: bool = False, mask: Mask | None = None,
                 create_graph: bool = True, grad_sync: GradSync | None = None) -> None:
        super().__init__(module, adamw(lr, betas, eps, weight_decay, maximize,
                                       eps_root=eps_root, mask=mask,
                                       moment_requires_grad=moment_requires_grad),
                         create_graph=create_graph, grad_sync=grad_sync)


class MetaRMSProp(MetaOptimizer):
    """Differentiable ``torch.optim.RMSprop`` bound to ``module`` (``lr`` may be a tensor);
    TorchOpt's extras: see :class:`metadist.meta.adaptive.RMSProp`."""

    def __init__(self, module: nn.Module, lr: Scalar = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.0,
                 centered: bool = False, maximize: bool = False, *, initial_scale: float = 0.0,
                 nesterov: bool = False, moment_requires_grad: bool = False,
                 create_graph: bool = True, grad_sync: GradSync | None = None) -> None:
        super().__init__(module, rmsprop(lr, alpha, eps, weight_decay, momentum, centered,
                                         maximize, initial_scale=initial_scale,
                                         nesterov=nesterov,
                                         moment_requires_grad=moment_requires_grad),
                         create_graph=create_graph, grad_sync=grad_sync)


class MetaAdaGrad(MetaOptimizer):
    """Differentiable ``torch.optim.Adagrad`` bound to ``module`` (``lr`` may be a tensor)."""

    def __init__(self, module: nn.Module, lr: Scalar = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, maximize: bool = False, *, create_graph: bool = True,
                 grad_sync: GradSync | None = None) -> None:
        super().__init__(module, adagrad(lr, lr_decay, weight_decay, initial_accumulator_value,
                                         eps, maximize),
                         create_graph=create_graph, grad_sync=grad_sync)


class MetaAdaDelta(MetaOptimizer):
    """Differentiable ``torch.optim.Adadelta`` bound to ``module`` (``lr`` may be a tensor)."""

    def __init__(self, module: nn.Module, lr: Scalar = 1.0, rho: float = 0.9,
                 eps: float = 1e-6, weight_decay: float = 0.0, maximize: bool = False, *,
                 moment_requires_grad: bool = False, create_graph: bool = True,
                 grad_sync: GradSync | None = None) -> None:
        super().__init__(module, adadelta(lr, rho, eps, weight_decay, maximize,
                                          moment_requires_grad=moment_requires_grad),
                         create_graph=create_graph, grad_sync=grad_sync)


class MetaAdaMax(MetaOptimizer):
    """Differentiable ``torch.optim.Adamax`` bound to ``module`` (``lr`` may be a tensor)."""

    def __init__(self, module: nn.Module, lr: Scalar = 2e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, maximize: bool = False, *,
                 moment_requires_grad: bool = False, create_graph: bool = True,
                 grad_sync: GradSync | None = None) -> None:
        super().__init__(module, adamax(lr, betas, eps, weight_decay, maximize,
                                        moment_requires_grad=moment_requires_grad),
                         create_graph=create_graph, grad_sync=grad_sync)


class MetaRAdam(MetaOptimizer):
    """Differentiable ``torch.optim.RAdam`` bound to ``module`` (``lr`` may be a tensor)."""

    def __init__(self, module: nn.Module, lr: Scalar = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled_weight_decay: bool = False,
                 maximize: bool = False, *, moment_requires_grad: bool = False,
                 create_graph: bool = True, grad_sync: GradSync | None = None) -> None:
        super().__init__(module, radam(lr, betas, eps, weight_decay, decoupled_weight_decay,
                                       maximize, moment_requires_grad=moment_requires_grad),
                         create_graph=create_graph, grad_sync=grad_sync)
