"""zero3/hsdp slices as the user sees them: element-wise arithmetic and whole reductions.

Under zero3/fsdp/hsdp a rank holds a slice of each parameter (strategies/zero3/
sharded_param.py: ``model.parameters()`` runs computations on it), inside flat shards of
whole units (several parameters each, padded), and of its gradient. Element-wise
arithmetic on them (an optimizer's update, ``p.grad.mul_(c)``, ``p.data.clamp_(-c, c)``)
is what one process computes on those elements. Anything that combines elements (a norm of
the gradients written by hand, a max, a reshape, indexing, concatenation) computes this
rank's part instead, and nothing would show it. Guarding the entry points we thought of
(``clip_grad_norm_``, ``get_total_norm``: strategies/tensors/grad_norm.py) left every other path
open, so the shard's type carries the rule instead:

* the shard is a :class:`ShardParameter`, its gradient and every tensor a program computes
  from either (optimizer state included) a :class:`ShardValue`;
* a reduction over all of a shard value's elements that needs no gradient (a norm of a
  gradient written by hand, its largest element) is computed over the unit's parameters,
  as one process computes it, in one all-reduce (whole_reductions.py);
* a call a program makes whose operators combine elements raises, naming what to call
  instead (``policy.ElementWise`` watches the operators torch runs; ``policy.ACROSS`` names
  the calls that run none, such as ``numpy``); freezing some shards but not all stops at
  the next forward (:func:`check_toggles`): a shard freezes its whole unit;
* the packages that own shards (strategies, checkpoint, comm, runtime, meta, testing) work
  on them as on plain tensors, and what they compute is plain: the call's first frame
  outside torch decides (a torch function such as an optimizer's step is judged by the code
  that called it).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from metadist.strategies.tensors.policy import (
    ACROSS,
    PLAIN,
    WHOLE,
    ElementWise,
    function_name,
    known_element_wise,
    masked_assignment,
)
from metadist.strategies.tensors.shard_piece import internal
from metadist.strategies.tensors.whole_reductions import (
    called_by_owner,
    carry,
    full_of,
    local_caller,
    reduce_whole,
    span_of,
)

# Run as on plain tensors: printing, autograd's entry points, pickling, and an explicit
# ``p.as_subclass(torch.Tensor)`` (this rank's slice, asked for by name).
_PLAIN = PLAIN | {"_grad", "__reduce_ex__", "as_subclass"}
_ADVICE = (
    "under zero3/fsdp/hsdp each rank holds a slice of every parameter, of its gradient and "
    "of its optimizer state, so it would compute this rank's part, not what one process "
    "computes. Element-wise arithmetic (p.grad.mul_(c), p.data.clamp_(-c, c)) and whole "
    "reductions of values without a gradient (p.grad.norm(), p.abs().max()) are exact as "
    "they are; use torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) for "
    "clipping, model.full_parameters() for whole parameters by name (a collective), "
    "model.state_dict() for values and the optimizer's weight_decay for an L2 penalty")

_AMP_ADVICE = (
    "torch's GradScaler looks for inf/nan in this rank's shards alone, so ranks whose shards "
    "differ would skip different steps and the model would leave one process's path; use "
    "metadist.strategy(..., precision=\"16-mixed\"), whose loss scaler agrees across ranks "
    "before any step")


def _as_value(t: Any) -> Any:
    if isinstance(t, Tensor) and not isinstance(t, ShardValue):
        return t.as_subclass(ShardValue)
    return t


def _has_plain_tensor(args: Any, kwargs: Any) -> bool:
    found = False

    def look(t: Any) -> Any:
        nonlocal found
        if isinstance(t, Tensor) and not isinstance(t, ShardValue) and t.numel() > 1:
            found = True
        return t

    tree_map(look, (args, kwargs))
    return found


#: types whose ``__torch_function__`` decides a call they appear in (zero3's parameters,
#: strategies/zero3/sharded_param.py, which then run it on slices of the shards)
DEFERS_TO: tuple[type, ...] = ()

_GRAD: Any = vars(torch._C.TensorBase)["grad"]  # the descriptor autograd's gradient is behind


class ShardValue(Tensor):
    """A shard's gradient, or a tensor a program computed from a shard (module notes)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if DEFERS_TO and any(issubclass(t, DEFERS_TO) for t in types):
            return NotImplemented  # a zero3 parameter in the call: its type decides
        kwargs = kwargs or {}
        name = function_name(func, setters=True)
        if name in _PLAIN or internal() or called_by_owner():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        plain_call = masked_assignment(name, args) or known_element_wise(name)
        if (name in WHOLE and not local_caller()
                and (whole := reduce_whole(name, args, kwargs)) is not None):
            return whole  # over the unit, as one process computes it (whole_reductions.py)
        if name in ACROSS and not plain_call:
            raise ValueError(f"{name} across the elements of a zero3/hsdp shard: {_ADVICE}")
        watch = contextlib.nullcontext() if plain_call else ElementWise(
            lambda op: f"{name} (which runs {op}) across the elements of a zero3/hsdp "
            f"shard: {_AMP_ADVICE if op.startswith('_amp_') else _ADVICE}")
        try:
            with torch._C.DisableTorchFunctionSubclass(), watch:
                out = func(*args, **kwargs)
        except RuntimeError as e:
            if _has_plain_tensor(args, kwargs):  # e.g. an EMA copy's parameter and a shard
                raise RuntimeError(f"{e}\nOne of these tensors is a zero3/hsdp shard: "
                                   f"{_ADVICE}") from e
            raise
        out = tree_map(_as_value, out)
        carry(out, args, kwargs)
        return out

    def full_tensor(self) -> Tensor:
        """Collective, as DTensor's: the whole tensor this is this rank's slice of
        (whole_reductions.py ``full_of``)."""
        return full_of(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved as a plain tensor: a file loads without metadist (``weights_only`` too)."""
        with torch._C.DisableTorchFunctionSubclass():
            return Tensor.__reduce_ex__(self.as_subclass(Tensor), protocol)


class ShardParameter(nn.Parameter, ShardValue):
    """A zero3/hsdp flat shard, as ``model.parameters()`` yields it: its ``grad`` is a
    :class:`ShardValue` however autograd stored it."""

    __torch_function__ = ShardValue.__torch_function__

    @property
    def grad(self) -> Tensor | None:
        value: Tensor | None = _GRAD.__get__(self)
        if value is not None and not isinstance(value, ShardValue):
            # autograd stores plain tensors: typed once, then the same object every read
            value = value.as_subclass(ShardValue)
            _GRAD.__set__(self, value)
        if value is not None and span_of(value) is None and span_of(self) is not None:
            value._metadist_span = span_of(self)  # type: ignore[attr-defined]
        return value

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        _GRAD.__set__(self, value)

    def __reduce_ex__(self, protocol: Any) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return nn.Parameter.__reduce_ex__(
                nn.Parameter(self.as_subclass(Tensor), self.requires_grad), protocol)
