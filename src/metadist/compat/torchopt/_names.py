"""The drop-in's classes under TorchOpt's module paths, pickled under metadist's.

[Note: TorchOpt's names, pickles that load anywhere]
A TorchOpt program sees ``torchopt.optim.meta.adam.MetaAdam`` in reprs, error messages and
``type(x).__module__``; the drop-in's classes say the same (:data:`TORCHOPT_MODULES`, TorchOpt
0.7.3's own paths). Pickle finds a class by its module path, and that path names a package
that may not be installed (or is TorchOpt itself, whose class is another one), so an instance
is pickled through :func:`_rebuild` with the class's name in this registry instead: a
checkpoint of an optimizer state written by the drop-in loads wherever metadist is, with or
without TorchOpt. (A class object itself, pickled on its own, names TorchOpt's module.)
"""

from __future__ import annotations

import sys
from typing import Any

#: where TorchOpt 0.7.3 defines each class of the drop-in
TORCHOPT_MODULES = {
    "MaskedNode": "torchopt.transform.add_decayed_weights",
    "AdamOp": "torchopt.accelerated_op.adam_op",
    "GradientTransformation": "torchopt.base",
    "EmptyState": "torchopt.base",
    "UninitializedState": "torchopt.base",
    "ChainedGradientTransformation": "torchopt.base",
    "IdentityGradientTransformation": "torchopt.base",
    "ImplicitMetaGradientModule": "torchopt.diff.implicit.nn.module",
    "ZeroOrderGradientModule": "torchopt.diff.zero_order.nn.module",
    "MetaGradientModule": "torchopt.nn.module",
    "MetaInputsContainer": "torchopt.nn.module",
    "Samplable": "torchopt.typing",
    "WrappedSamplable": "torchopt.diff.zero_order.decorator",
    "TensorDimensionPartitioner": "torchopt.distributed.api",
    "WorldInfo": "torchopt.distributed.world",
    "Optimizer": "torchopt.optim.base",
    "SGD": "torchopt.optim.sgd",
    "Adam": "torchopt.optim.adam",
    "AdamW": "torchopt.optim.adamw",
    "AdaMax": "torchopt.optim.adamax",
    "AdaDelta": "torchopt.optim.adadelta",
    "AdaGrad": "torchopt.optim.adagrad",
    "RAdam": "torchopt.optim.radam",
    "RMSProp": "torchopt.optim.rmsprop",
    "FuncOptimizer": "torchopt.optim.func.base",
    "MetaOptimizer": "torchopt.optim.meta.base",
    "MetaSGD": "torchopt.optim.meta.sgd",
    "MetaAdam": "torchopt.optim.meta.adam",
    "MetaAdamW": "torchopt.optim.meta.adamw",
    "MetaAdaMax": "torchopt.optim.meta.adamax",
    "MetaAdaDelta": "torchopt.optim.meta.adadelta",
    "MetaAdaGrad": "torchopt.optim.meta.adagrad",
    "MetaRAdam": "torchopt.optim.meta.radam",
    "MetaRMSProp": "torchopt.optim.meta.rmsprop",
    "ScaleByScheduleState": "torchopt.transform.scale_by_schedule",
    "MaskedState": "torchopt.transform.add_decayed_weights",
    "TraceState": "torchopt.transform.trace",
    "ScaleByAdamState": "torchopt.transform.scale_by_adam",
    "ScaleByRmsState": "torchopt.transform.scale_by_rms",
    "ScaleByRStdDevState": "torchopt.transform.scale_by_stddev",
    "ScaleByRssState": "torchopt.transform.scale_by_rss",
    "ScaleByAdamaxState": "torchopt.transform.scale_by_adamax",
    "ScaleByAdadeltaState": "torchopt.transform.scale_by_adadelta",
    "ScaleByRAdamState": "torchopt.transform.scale_by_radam",
    "ModuleState": "torchopt.utils",
}

_CLASSES: dict[str, type] = {}


def _rebuild(name: str, reduced: tuple[Any, ...]) -> Any:
    """Unpickle an instance of the drop-in's class ``name``: a NamedTuple from its fields,
    anything else from what ``object.__reduce_ex__`` gave (its constructor and arguments,
    the class in place of its name)."""
    cls = _CLASSES[name]
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return cls(*reduced)
    make, args = reduced
    return make(cls, *args)


def _reduce_ex(self: Any, protocol: int) -> Any:
    """Pickle through :func:`_rebuild` (see the module notes)."""
    cls = type(self)
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return _rebuild, (cls.__qualname__, tuple(self))
    reduced: Any = object.__reduce_ex__(self, protocol)
    make, args, *rest = reduced
    # args[0] is the class: named instead (pickle would look it up by its module path)
    return (_rebuild, (cls.__qualname__, (make, args[1:])), *rest)


def present_as_torchopts(classes: list[type]) -> None:
    """Give ``classes`` TorchOpt's module paths, and pickles that load without TorchOpt."""
    for cls in classes:
        name = cls.__qualname__
        if name not in TORCHOPT_MODULES or _CLASSES.get(name) is cls:
            continue
        _CLASSES[name] = cls
        cls.__module__ = TORCHOPT_MODULES[name]
        cls.__reduce_ex__ = _reduce_ex  # type: ignore[method-assign, assignment]


def present_loaded() -> None:
    """:func:`present_as_torchopts` for the classes of every drop-in module loaded so far
    (the package and its lazily imported subpackages call it once they are loaded)."""
    found = [value for name, module in list(sys.modules.items())
             if name.startswith(_PACKAGE) and module is not None
             for value in list(vars(module).values())
             if isinstance(value, type) and value.__module__.startswith(_PACKAGE)]
    present_as_torchopts(found)


_PACKAGE = "metadist.compat.torchopt"
