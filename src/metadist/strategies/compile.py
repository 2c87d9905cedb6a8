"""torch.compile under every strategy: what is compiled, and where compiled code stops.

A set-up model is compiled the way a plain one is: ``torch.compile(model)`` or
``model.compile()`` after setup, or either on the user's module before setup (setup then sees
through it and compiles the set-up model with the same options). Where compiled code starts
and ends is metadist's decision, made once for every strategy:

* the strategy's own forward-time work (gathers into flat buffers, frees, prefetches, buffer
  broadcasts, the hooks that start reduce-scatters) is never traced. Dynamo cannot trace
  storage resizes and collectives, and a graph that captured them would replay the
  collective sizes and buffer states of the step it was traced on;
* the computation between is compiled as *pieces*, each a module whose ``forward`` runs under
  the compile: the user's whole module for the replicating strategies (single, ddp, zero1,
  zero2: they have no work inside it), and for zero3/hsdp each unit's member module (its
  gather and free hooks run around its ``forward``, outside the compiled code, as FSDP2's
  per-block compile has them), plus the modules that own root-unit parameters. Code that
  runs between units (the forward of a module that calls units, parameter-free layers
  outside units) runs eagerly; see docs/compile.md.

How: the set-up model's ``__call__`` (:func:`call`) is a frame Dynamo skips: it is not
traced and costs no graph break. It notes the compile callback ``torch.compile`` installed,
runs the strategy's work with Dynamo off, and each piece's ``forward`` (:func:`_piece_forward`,
installed on the first compiled call) turns that callback back on around a function Dynamo
compiles: one per piece *kind* (class and parameter shapes), so identical blocks share one
compiled graph and different ones never turn each other's shapes dynamic.

The callback is read and set through Dynamo's frame-evaluation hooks
(``torch._C._dynamo.eval_frame``): torch.compile has no public way to compile "this
function with the options the caller was compiled with".
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

import torch
from torch import nn
from torch._C._dynamo import eval_frame as _eval_frame

from metadist.strategies.zero3.wrap import NO_FORWARD, is_checkpoint_wrapper

F = TypeVar("F", bound=Callable[..., Any])


class SetUpModel(Protocol):
    """What this file needs of a set-up model (strategies/module.py's DistributedModule)."""

    _compiled_call_impl: Callable[..., Any] | None
    __dict__: dict[str, Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any: ...

    def compile_pieces(self) -> list[nn.Module]: ...

    def wait_params(self) -> None: ...


#: The compile callback of the set-up model whose forward is running (None: eager).
_ACTIVE: ContextVar[Any] = ContextVar("metadist_compile_callback", default=None)

#: Attribute a set-up model keeps its pieces under once installed.
_INSTALLED = "_metadist_compile_pieces"


def _skip_frame(fn: F) -> F:
    """Dynamo runs ``fn``'s frames without tracing them (functions they call are still seen);
    code that Dynamo traces and calls ``fn`` breaks its graph there instead of inlining it.
    (``torch._dynamo``'s own helper would import Dynamo, seconds, with ``import metadist``.)"""
    set_strategy = getattr(_eval_frame, "set_code_exec_strategy", None)
    if set_strategy is not None:
        action = _eval_frame._FrameAction
        set_strategy(fn.__code__, _eval_frame._FrameExecStrategy(action.SKIP, action.DEFAULT))
    elif hasattr(_eval_frame, "skip_code"):  # torch before frame execution strategies
        _eval_frame.skip_code(fn.__code__)
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    return fn


def eager(fn: F) -> F:
    """``fn`` never runs under Dynamo (``torch.compiler.disable`` without importing Dynamo):
    the strategy's hooks, reached from a module a user compiled on their own."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        prior = _eval_frame.set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            _eval_frame.set_eval_frame(prior)

    return _skip_frame(run)  # type: ignore[return-value]


@_skip_frame
def call(model: SetUpModel, *args: Any, **kwargs: Any) -> Any:
    """A set-up model's ``__call__``. Dynamo never traces it; under a compile (this frame
    runs with a compile callback: ``torch.compile(model)``, or ``model.compile()`` whose
    compiled call comes back here) it runs the model with Dynamo off and its pieces
    (``model.compile_pieces()``) compiled with that callback."""
    # Dynamo off first: this frame is skipped, not the Python functions it calls.
    prior = _eval_frame.set_eval_frame(None)
    callback = prior if prior is not None else _ACTIVE.get()
    if callback is None:
        _eval_frame.set_eval_frame(prior)
        return nn.Module.__call__(model, *args, **kwargs)  # model.compile()'s comes back
    token = _ACTIVE.set(callback)
    try:
        _install(model)
        model.wait_params()  # no parameter refresh in flight: pieces read settled values
        return model._call_impl(*args, **kwargs)
    finally:
        _ACTIVE.reset(token)
        _eval_frame.set_eval_frame(prior)


def compile_call(model: SetUpModel, compile: Callable[[Callable[..., Any]], Any]) -> None:
    """``model.compile()`` for a set-up model: ``compile`` (torch.compile with the user's
    options) is applied to :func:`call`, not to the model's whole forward."""
    model._compiled_call_impl = compile(model.__call__)


def _install(model: SetUpModel) -> None:
    """Give every piece of ``model`` its compiling ``forward`` (once)."""
    if model.__dict__.get(_INSTALLED) is not None:
        return
    pieces = list(model.compile_pieces())
    for piece in pieces:
        if _is_piece(piece):
            continue  # a piece of another set-up model (nested): installed there
        if "forward" in piece.__dict__:
            raise RuntimeError(
                f"{type(piece).__name__} has a forward set on the instance (e.g. "
                "module.forward = torch.compile(module.forward)); metadist compiles each "
                "piece's forward itself: leave forward as the class defines it and compile "
                "the model (torch.compile(model) before or after strategy.setup)")
        # a partial of a module-level function: the module still deep-copies and pickles
        piece.__dict__["forward"] = functools.partial(_piece_forward, piece)
    model.__dict__[_INSTALLED] = pieces


def _is_piece(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _piece_forward


#: The callback each piece last ran compiled with, for activation checkpointing's
#: recomputation in backward: it must replay the graph the forward ran, whose saved tensors
#: are not eager's.
_LAST: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


@_skip_frame
def _piece_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A piece's ``forward``: compiled with the running compile's callback (its recomputation
    in backward with the callback its forward ran with), eager outside a compile (a call
    outside the set-up model's forward)."""
    callback = _ACTIVE.get()
    if callback is None and torch._C._current_graph_task_id() != -1:  # recomputing
        callback = _LAST.get(module)
    else:
        _LAST[module] = callback
    if callback is None:
        return type(module).forward(module, *args, **kwargs)
    compiled = _KIND_OF.get(module)
    if compiled is None:
        compiled = _KIND_OF[module] = _kind(module)
    prior = _eval_frame.set_eval_frame(callback)
    try:
        return compiled(module, *args, **kwargs)
    finally:
        _eval_frame.set_eval_frame(prior)


def _call_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What Dynamo compiles for a piece: its class's forward, inlined (a torch.nn forward is
    not a frame Dynamo compiles by itself)."""
    return type(module).forward(module, *args, **kwargs)


# One copy of _call_forward per piece kind: Dynamo keeps compiled graphs per code object, so
# each kind gets its own cache (and recompile limit), and same-kind pieces share graphs.
_KINDS: dict[tuple[Any, ...], Callable[..., Any]] = {}
_KIND_OF: weakref.WeakKeyDictionary[nn.Module, Callable[..., Any]] = weakref.WeakKeyDictionary()


@eager  # called where a compile may be running: a function of shapes, not to trace
def _kind(module: nn.Module) -> Callable[..., Any]:
    shapes = tuple((name, tuple(t.shape), t.dtype) for name, t in _tensors(module))
    key = (type(module), shapes)
    fn = _KINDS.get(key)
    if fn is None:
        name = f"{type(module).__name__}_forward_{len(_KINDS)}"
        code = _call_forward.__code__.replace(co_name=name)
        fn = types.FunctionType(code, _call_forward.__globals__, name)
        _KINDS[key] = fn
    return fn


def _tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Parameters and buffers of ``module``'s subtree, including tensors placed as plain
    attributes."""
    for prefix, m in module.named_modules():
        for attr, value in m.__dict__.items():
            if isinstance(value, torch.Tensor):
                yield f"{prefix}.{attr}", value
        for attr, value in [*m._parameters.items(), *m._buffers.items()]:
            if value is not None:
                yield f"{prefix}.{attr}", value


# ----- compiled before setup ------------------------------------------------------------
def _context_of(fn: Any) -> Any:
    """The torch.compile context that made ``fn`` (``module.compile()``'s compiled call)."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


def take_compile(model: nn.Module) -> tuple[nn.Module, Any]:
    """``model`` without a compile applied to it as a whole before setup, and that
    compile's context: ``torch.compile(model)`` is seen through to the module it wraps,
    ``model.compile()`` is undone. Setup compiles the set-up model with it instead, so that
    metadist's own work stays out of the compiled code."""
    if "torch._dynamo" not in sys.modules:
        return model, None  # nothing was compiled in this process
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(model, OptimizedModule):
        inner: nn.Module = model._orig_mod
        if isinstance(inner, OptimizedModule) or inner._compiled_call_impl is not None:
            raise ValueError("this model was compiled twice (torch.compile of a module "
                             "compiled in place with module.compile()); compile it once, "
                             "before or after strategy.setup")
        return inner, model.dynamo_ctx
    compiled = model._compiled_call_impl
    if compiled is None:
        return model, None
    context = _context_of(compiled)
    if context is None:
        raise ValueError(
            "the model's compiled call (model._compiled_call_impl) was not made by "
            "model.compile(); compile the set-up model instead: model = "
            "torch.compile(strategy.setup_module(model))")
    model._compiled_call_impl = None
    return model, context


def compile_setup(model: SetUpModel, context: Any) -> None:
    """Compile the set-up ``model`` with ``context``: ``model.compile(...)`` with the options
    the user's module was compiled with."""
    model.compile_pieces()  # raises now, at setup, where the strategy cannot compile
    compile_call(model, context)


#: A module class that sets this attribute to True runs eagerly under torch.compile: never
#: compiled nor traced inside a piece (its forward runs collectives, e.g. SyncBatchNorm).
EAGER = "compile_eagerly"


def _holds_tensors(m: nn.Module) -> bool:
    """Parameters or buffers, or tensors a sharding strategy bound in their place."""
    return bool(m._parameters or m._buffers) or any(
        isinstance(v, torch.Tensor) for v in m.__dict__.values())


def pieces(root: nn.Module, hooked: set[nn.Module]) -> list[nn.Module]:
    """The pieces of the user's module ``root`` when the strategy runs work around the
    forward of the ``hooked`` modules: the largest subtrees with neither a hooked module nor
    one that runs eagerly (:data:`EAGER`, activation checkpointing's wrappers) strictly
    inside, that are hooked themselves or hold tensors. A container whose forward never
    runs (``ModuleList`` ...) is never a piece: its children are."""
    eagerly = {m for m in root.modules() if getattr(m, EAGER, False) or is_checkpoint_wrapper(m)}
    blocked = hooked | eagerly
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        inner = [c for c in m.modules() if c is not m]
        if (m not in eagerly and not isinstance(m, NO_FORWARD)
                and not any(c in blocked for c in inner)):
            if m in hooked or any(_holds_tensors(c) for c in (m, *inner)):
                out.append(m)
            return
        for child in m.children():
            visit(child)

    visit(root)
    return out
