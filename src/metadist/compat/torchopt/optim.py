"""TorchOpt's optimiser classes with TorchOpt's signatures (positional order included):

* ``MetaOptimizer(module, impl)`` and ``MetaSGD``, ``MetaAdam``, ... : differentiable steps
  of a module's parameters, written back into the module's parameter containers;
* ``Optimizer(params, impl)`` and ``SGD``, ``Adam``, ... : torch-style in-place optimisers;
* ``FuncOptimizer(impl)``: ``step(loss, params) -> new params``.

States are the tuples TorchOpt's ``state_dict()`` returns (one entry per parameter group);
their entries are metadist's state objects, so a state round-trips through ``state_dict`` /
``load_state_dict`` / ``extract_state_dict`` but is not TorchOpt's internal namedtuple.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from metadist.compat.torchopt import alias
from metadist.compat.torchopt.alias import GradientTransformation
from metadist.compat.torchopt.update import apply_updates
from metadist.meta.modules import unwrap
from metadist.strategies.bind import write

_UNSET = object()  # a group's state before its first step (TorchOpt's lazy init)


def _check(impl: Any) -> GradientTransformation:
    if not isinstance(impl, GradientTransformation):
        raise TypeError(f"{impl!r} (type: {type(impl).__name__}) is not a TorchOpt-style "
                        "GradientTransformation (build it with torchopt.sgd(...), adam(...), "
                        "chain(...))")
    return impl


class MetaOptimizer:
    """Differentiable optimiser over ``module``'s parameters (TorchOpt's)."""

    def __init__(self, module: nn.Module, impl: GradientTransformation) -> None:
        self.impl = _check(impl)
        self.param_containers_groups: list[list[dict[str, Any]]] = []
        self.state_groups: list[Any] = []
        self.add_param_group(module)

    def add_param_group(self, module: nn.Module) -> None:
        containers = [m._parameters for m in unwrap(module).modules() if m._parameters]
        self.param_containers_groups.append(containers)
        self.state_groups.append(_UNSET)

    def step(self, loss: Tensor) -> None:
        """Gradients of ``loss`` with the graph kept, one update, and the new tensors written
        into the module (so the next forward uses them)."""
        for i, containers in enumerate(self.param_containers_groups):
            keys = [(c, k) for c in containers for k, v in c.items() if v is not None]
            flat = tuple(c[k] for c, k in keys)
            state = self.state_groups[i]
            if state is _UNSET:
                state = self.impl.init(flat)
            grads = torch.autograd.grad(loss, flat, create_graph=True, allow_unused=True)
            updates, self.state_groups[i] = self.impl.update(grads, state, params=flat,
                                                             inplace=False)
            # each (container, key) is a place of strategies/bind.py: written and kept
            write(zip(keys, apply_updates(flat, updates, inplace=False), strict=True))

    def state_dict(self) -> tuple[Any, ...]:
        """References to the states, one per parameter group."""
        return tuple(self.state_groups)

    def load_state_dict(self, state_dict: Sequence[Any]) -> None:
        self.state_groups[:] = list(state_dict)


class MetaSGD(MetaOptimizer):
    def __init__(self, module: nn.Module, lr: Any, momentum: float = 0.0,
                 weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 moment_requires_grad: bool = True, maximize: bool = False) -> None:
        super().__init__(module, alias.sgd(lr, momentum, dampening, weight_decay, nesterov,
                                           moment_requires_grad=moment_requires_grad,
                                           maximize=maximize))


class MetaAdam(MetaOptimizer):
    def __init__(self, module: nn.Module, lr: Any = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, eps_root: float = 0.0,
                 moment_requires_grad: bool = True, maximize: bool = False,
                 use_accelerated_op: bool = False) -> None:
        super().__init__(module, alias.adam(lr, betas, eps, weight_decay, eps_root=eps_root,
                                            moment_requires_grad=moment_requires_grad,
                                            maximize=maximize))


class MetaAdamW(MetaOptimizer):
    def __init__(self, module: nn.Module, lr: Any = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, eps_root: float = 0.0, mask: Any = None,
                 moment_requires_grad: bool = False, maximize: bool = False,
                 use_accelerated_op: bool = False) -> None:
        super().__init__(module, alias.adamw(lr, betas, eps, weight_decay, eps_root=eps_root,
                                             mask=mask,
                                             moment_requires_grad=moment_requires_grad,
                                             maximize=maximize))


class MetaRMSProp(MetaOptimizer):
    def __init__(self, module: nn.Module, lr: Any = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.0,
                 centered: bool = False, *, initial_scale: float = 0.0, nesterov: bool = False,
                 maximize: bool = False) -> None:
        super().__init__(module, alias.rmsprop(lr, alpha, eps, weight_decay, momentum, centered,
                                               initial_scale=initial_scale, nesterov=nesterov,
                                               maximize=maximize))


class MetaAdaGrad(MetaOptimizer):
    def __init__(self, module: nn.Module, lr: Any = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, *, maximize: bool = False) -> None:
        super().__init__(module, alias.adagrad(lr, lr_decay, weight_decay,
                                               initial_accumulator_value, eps,
                                               maximize=maximize))


class MetaAdaDelta(MetaOptimizer):
    def __init__(self, module: nn.Module, lr: Any = 1.0, rho: float = 0.9, eps: float = 1e-6,
                 weight_decay: float = 0.0, *, moment_requires_grad: bool = True) -> None:
        super().__init__(module, alias.adadelta(lr, rho, eps, weight_decay,
                                                moment_requires_grad=moment_requires_grad))


class MetaAdaMax(MetaOptimizer):
    def __init__(self, module: nn.Module, lr: Any = 2e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, moment_requires_grad: bool = True) -> None:
        super().__init__(module, alias.adamax(lr, betas, eps, weight_decay,
                                              moment_requires_grad=moment_requires_grad))


class MetaRAdam(MetaOptimizer):
    def __init__(self, module: nn.Module, lr: Any = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, moment_requires_grad: bool = True) -> None:
        super().__init__(module, alias.radam(lr, betas, eps, weight_decay,
                                             moment_requires_grad=moment_requires_grad))


class Optimizer:
    """TorchOpt's torch-style optimiser: ``zero_grad()``, ``loss.backward()``, ``step()``
    update the parameters in place (no graph through the step)."""

    def __init__(self, params: Iterable[Tensor], impl: GradientTransformation) -> None:
        self.impl = _check(impl)
        self.param_groups: list[tuple[Tensor, ...]] = []
        self.state_groups: list[Any] = []
        self.add_param_group(params)

    def add_param_group(self, params: Iterable[Tensor]) -> None:
        group = tuple(params)
        self.param_groups.append(group)
        self.state_groups.append(self.impl.init(group))

    def zero_grad(self, set_to_none: bool = False) -> None:
        for group in self.param_groups:
            for p in group:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    @torch.no_grad()
    def _apply(self) -> None:
        for i, group in enumerate(self.param_groups):
            grads = tuple(p.grad for p in group)
            updates, self.state_groups[i] = self.impl.update(grads, self.state_groups[i],
                                                             params=group, inplace=True)
            apply_updates(group, updates, inplace=True)

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._apply()
        return loss

    def state_dict(self) -> tuple[Any, ...]:
        return tuple(self.state_groups)

    def load_state_dict(self, state_dict: Sequence[Any]) -> None:
        self.state_groups[:] = list(state_dict)


# The torch-style classes: TorchOpt's own defaults, which differ from its functions' in
# places (AdaMax: lr 2e-3, eps 1e-8; RAdam: eps 1e-8; AdaDelta: lr 1.0).
class SGD(Optimizer):
    def __init__(self, params: Iterable[Tensor], lr: Any, momentum: float = 0.0,
                 weight_decay: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 maximize: bool = False) -> None:
        super().__init__(params, alias.sgd(lr, momentum, dampening, weight_decay, nesterov,
                                           maximize=maximize))


class Adam(Optimizer):
    def __init__(self, params: Iterable[Tensor], lr: Any = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, eps_root: float = 0.0, maximize: bool = False,
                 use_accelerated_op: bool = False) -> None:
        super().__init__(params, alias.adam(lr, betas, eps, weight_decay, eps_root=eps_root,
                                            maximize=maximize))


class AdamW(Optimizer):
    def __init__(self, params: Iterable[Tensor], lr: Any = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, eps_root: float = 0.0, mask: Any = None,
                 maximize: bool = False, use_accelerated_op: bool = False) -> None:
        super().__init__(params, alias.adamw(lr, betas, eps, weight_decay, eps_root=eps_root,
                                             mask=mask, maximize=maximize))


class RMSProp(Optimizer):
    def __init__(self, params: Iterable[Tensor], lr: Any = 1e-2, alpha: float = 0.99,
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = 0.0,
                 centered: bool = False, *, initial_scale: float = 0.0, nesterov: bool = False,
                 maximize: bool = False) -> None:
        super().__init__(params, alias.rmsprop(lr, alpha, eps, weight_decay, momentum, centered,
                                               initial_scale=initial_scale, nesterov=nesterov,
                                               maximize=maximize))


class AdaGrad(Optimizer):
    def __init__(self, params: Iterable[Tensor], lr: Any = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, *, maximize: bool = False) -> None:
        super().__init__(params, alias.adagrad(lr, lr_decay, weight_decay,
                                               initial_accumulator_value, eps,
                                               maximize=maximize))


class AdaMax(Optimizer):
    def __init__(self, params: Iterable[Tensor], lr: Any = 2e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, alias.adamax(lr, betas, eps, weight_decay))


class RAdam(Optimizer):
    def __init__(self, params: Iterable[Tensor], lr: Any = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, alias.radam(lr, betas, eps, weight_decay))


class AdaDelta(Optimizer):
    """TorchOpt's ``AdaDelta(params, ...)``: lr defaults to 1.0 here (1e-3 in ``adadelta``)."""

    def __init__(self, params: Iterable[Tensor], lr: Any = 1.0, rho: float = 0.9,
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        super().__init__(params, alias.adadelta(lr, rho, eps, weight_decay))


class FuncOptimizer:
    """TorchOpt's functional optimiser: ``new_params = opt.step(loss, params)``."""

    def __init__(self, impl: GradientTransformation, *, inplace: bool = False) -> None:
        self.impl = _check(impl)
        self.optim_state: Any = _UNSET
        self.inplace = bool(inplace)

    def step(self, loss: Tensor, params: Any, inplace: bool | None = None) -> Any:
        if self.optim_state is _UNSET:
            self.optim_state = self.impl.init(params)
        inplace = self.inplace if inplace is None else inplace
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        updates, self.optim_state = self.impl.update(grads, self.optim_state, params=params,
                                                     inplace=inplace)
        return apply_updates(params, updates, inplace=inplace)

    def state_dict(self) -> Any:
        return self.optim_state

    def load_state_dict(self, state_dict: Any) -> None:
        self.optim_state = state_dict
