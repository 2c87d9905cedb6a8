"""Running a module on explicit tensors: one mechanism for every path that does it.

A module's forward reads each parameter and buffer by attribute, and an attribute read
finds the tensor in one of three dicts of the owning module: the instance ``__dict__`` (a
plain attribute), ``_parameters`` (zero3/hsdp's gathered views and placeholders too: the
registry holds what the attribute reads) or ``_buffers``. A
:data:`Place` names that dict and the key; writing a tensor there is what every binding
here does, and restoring what was there undoes it:

* :func:`bind_parameters` binds tensors by the names ``named_parameters``/``named_buffers``
  spell, for the duration of a ``with`` block (fast weights of an inner loop, a problem run
  on parameters no gradient reaches);
* :func:`rebind_parameters` writes them and keeps them (a differentiable optimiser step);
* :class:`Rebinding` is the block itself over any places: re-enterable, so activation
  checkpointing re-enters what a forward ran with (:func:`captured`) for each recomputation,
  and strategies place their own tensors with it (zero3's ``functional_forward``), or with
  :func:`write` where they keep them (a unit's gathered views).

A block also marks the module it binds as running on explicit parameters, and only that
module: strategies then leave its parameters alone (zero3's unit hooks neither gather nor
bind for it) while another module in the same block still runs on its own (the meta
engine binds one problem's module to fast weights while another gathers its shards).
Activation checkpointing captures the marks with the tensors and re-enters both.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar, Token
from typing import Any, NoReturn

from torch import Tensor, nn

#: The dict an attribute read finds a tensor in, and its key there.
Place = tuple[dict[str, Any], str]
#: What a place held before a write (``_MISSING``: nothing), to put back.
Saved = tuple[dict[str, Any], str, Any]

_MISSING = object()
#: ids of the root modules bound by the blocks now open, and of every dict they wrote
_EXPLICIT: ContextVar[frozenset[int]] = ContextVar("metadist_explicit_parameters",
                                                   default=frozenset())


def explicit_parameters_active(root: nn.Module) -> bool:
    """Whether ``root``'s forward runs on explicitly bound parameters (inside a
    :class:`Rebinding` of it): its strategy must not rebind its own there."""
    return id(root) in _EXPLICIT.get()


def task_active(root: nn.Module) -> bool:
    """Whether ``root`` runs a per-rank task on explicit parameters (a block opened with
    ``task=True``: ``functional_forward``), not the module itself on other tensors
    (``bound``, the meta engine's problems): a task's batch is its own
    (strategies/batchnorm/calls.py)."""
    return -id(root) in _EXPLICIT.get()


def explicit_marks() -> frozenset[int]:
    """The marks of the blocks now open (to re-enter them later, :class:`Rebinding`)."""
    return _EXPLICIT.get()


def bound_within(module: nn.Module, marks: frozenset[int]) -> bool:
    """Whether a block with ``marks`` wrote into ``module``'s subtree."""
    return bool(marks) and any(id(store) in marks for m in module.modules()
                               for store in (m._parameters, m._buffers, m.__dict__))


# ----- the primitive ----------------------------------------------------------------------
def place_of(owner: nn.Module, attr: str) -> Place:
    """Where ``owner.<attr>`` is read from, in Python's order: the instance dict first
    (``nn.Module.__getattr__`` only runs when it misses), then parameters, then buffers. An
    attribute found nowhere is placed in ``_parameters``, as ``functional_call`` would."""
    instance = owner.__dict__
    if attr in instance:
        return instance, attr
    buffers = instance["_buffers"]
    return (buffers if attr in buffers else instance["_parameters"]), attr


def held_at(owner: nn.Module, attr: str) -> Any:
    """What ``owner.<attr>`` reads now (None where nothing is placed)."""
    store, key = place_of(owner, attr)
    return store.get(key)


def write(assignments: Iterable[tuple[Place, Tensor]]) -> list[Saved]:
    """Put each tensor in its place; returns what was there, for :func:`restore`."""
    saved: list[Saved] = []
    for (store, key), value in assignments:
        saved.append((store, key, store.get(key, _MISSING)))
        store[key] = value
    return saved


def restore(saved: Sequence[Saved]) -> None:
    """Undo a :func:`write` (in reverse: a place written twice gets its first value back)."""
    for store, key, old in reversed(saved):
        if old is _MISSING:
            store.pop(key, None)
        else:
            store[key] = old


class Rebinding:
    """A block within which ``assignments`` are in place and ``root`` (and whatever the
    assignments write into) runs on explicit parameters; everything is restored on exit,
    also after an exception. ``marks``: further marks to hold (those captured from another
    block, :func:`explicit_marks`). Re-enterable and nestable: each entry saves what it
    replaces."""

    def __init__(self, assignments: Sequence[tuple[Place, Tensor]],
                 root: nn.Module | None = None, marks: frozenset[int] = frozenset(),
                 task: bool = False) -> None:
        self.assignments = assignments
        self.marks = marks | {id(store) for (store, _), _ in assignments} | (
            {id(root)} if root is not None else set()) | (
            {-id(root)} if root is not None and task else set())  # (ids are positive)
        self._stack: list[tuple[list[Saved], Token[frozenset[int]]]] = []

    def __enter__(self) -> None:
        saved = write(self.assignments)
        self._stack.append((saved, _EXPLICIT.set(_EXPLICIT.get() | self.marks)))

    def __exit__(self, *exc: object) -> None:
        saved, token = self._stack.pop()
        _EXPLICIT.reset(token)
        restore(saved)


def captured(module: nn.Module) -> list[tuple[Place, Tensor]]:
    """Every tensor ``module``'s subtree reads by attribute, where it reads it now:
    parameters and buffers, also those replaced by plain tensors (zero3's gathered views)."""
    out: list[tuple[Place, Tensor]] = []
    for m in module.modules():
        for store in (m._parameters, m._buffers, m.__dict__):
            out.extend(((store, key), t) for key, t in store.items()
                       if isinstance(t, Tensor))
    return out


# ----- by name ----------------------------------------------------------------------------
Owner = tuple[nn.Module | None, str]  # (owning module, attribute); None: the indexed root


class _Index:
    """Where each name of a module lives: every (owner, attribute) holding the tensor the
    name reads (several for tied weights). Built from one walk of the module tree; valid
    while every submodule found is still where it was (checked per use: one dict read per
    submodule, far cheaper than the walk)."""

    def __init__(self, root: nn.Module) -> None:
        # The root is never referenced (None stands for it): the index lives in a weak
        # dictionary keyed by the root, and a value referencing its key would keep it alive.
        self.edges: list[tuple[nn.Module | None, str, nn.Module]] = []
        groups: dict[int, list[Owner]] = {}
        names: dict[str, int] = {}
        seen: set[int] = set()
        for prefix, owner in root.named_modules(remove_duplicate=False):
            ref = None if owner is root else owner
            if id(owner) not in seen:
                seen.add(id(owner))
                self.edges.extend((ref, key, child) for key, child in owner._modules.items()
                                  if child is not None)
            for store in (owner._parameters, owner._buffers):
                for attr, tensor in store.items():
                    if tensor is None:
                        continue
                    group = groups.setdefault(id(tensor), [])
                    if (ref, attr) not in group:
                        group.append((ref, attr))
                    names[f"{prefix}.{attr}" if prefix else attr] = id(tensor)
        shared = {i: tuple(group) for i, group in groups.items()}  # one object per tensor
        self.names: dict[str, tuple[Owner, ...]] = {n: shared[i] for n, i in names.items()}
        count: dict[int, int] = {}
        for i in names.values():
            count[i] = count.get(i, 0) + 1
        #: owners reached under several names (tied weights, shared submodules), by id
        self.aliased = {id(shared[i]) for i, c in count.items() if c > 1}

    def valid(self, root: nn.Module) -> bool:
        for parent, key, child in self.edges:
            if (root if parent is None else parent)._modules.get(key) is not child:
                return False
        return True


_INDEXES: weakref.WeakKeyDictionary[nn.Module, _Index] = weakref.WeakKeyDictionary()


def _index(module: nn.Module, fresh: bool = False) -> _Index:
    index = None if fresh else _INDEXES.get(module)
    if index is None or not index.valid(module):
        index = _INDEXES[module] = _Index(module)
    return index


def _assignments(module: nn.Module, mapping: Mapping[str, Tensor]
                 ) -> list[tuple[Place, Tensor]]:
    out = _resolve(module, _index(module), mapping, strict=False)
    if out is None:  # a name added, an owner gone, a tie undone since the index was built
        out = _resolve(module, _index(module, fresh=True), mapping, strict=True)
        assert out is not None
    return out


def _resolve(module: nn.Module, index: _Index, mapping: Mapping[str, Tensor], strict: bool
             ) -> list[tuple[Place, Tensor]] | None:
    """The places of every name in ``mapping``; None where the index may be stale (a name
    it lacks, a tie undone), unless ``strict``: then a name the module does not have raises.
    Tied names given different tensors raise. (The meta layer binds several times a step:
    the common case, a name with one owner, costs a few dict reads.)"""
    out: list[tuple[Place, Tensor]] = []
    done: dict[int, tuple[str, Tensor]] = {}  # by id of the owners: aliases share them
    for name, value in mapping.items():
        owners = index.names.get(name)
        if owners is None:
            if not strict:
                return None
            _unknown(module, index, mapping)
        if id(owners) in index.aliased:
            first = done.get(id(owners))
            if first is not None:  # another name of the same tensor
                if first[1] is not value:
                    raise ValueError(f"{first[0]!r} and {name!r} name one tied tensor of "
                                     f"{type(module).__name__}; bind it under one name (or "
                                     "give both names the same tensor)")
                continue
            done[id(owners)] = (name, value)
        if len(owners) == 1:
            owner, attr = owners[0]
            out.append((place_of(module if owner is None else owner, attr), value))
            continue
        places = [place_of(module if owner is None else owner, attr) for owner, attr in owners]
        if not strict and len({id(store.get(key)) for store, key in places}) != 1:
            return None  # untied since: a fresh index groups them as they are now
        out.extend((place, value) for place in places)
    return out


def _unknown(module: nn.Module, index: _Index, mapping: Mapping[str, Tensor]) -> NoReturn:
    unknown = sorted(set(mapping) - set(index.names))
    valid = sorted(index.names)
    shown = ", ".join(valid[:12]) + (f" ... ({len(valid)} in all)" if len(valid) > 12 else "")
    raise ValueError(f"{type(module).__name__} has no parameter or buffer named "
                     f"{', '.join(map(repr, unknown))}; valid names (as named_parameters and "
                     f"named_buffers spell them): {shown or 'none'}")


def bind_parameters(module: nn.Module, mapping: Mapping[str, Tensor],
                    task: bool = False) -> Rebinding:
    """``with bind_parameters(module, {name: tensor}):`` the module's forward reads each
    named tensor (names relative to ``module``, as ``named_parameters``/``named_buffers``
    spell them; one name of a tied weight binds every use) and everything else as it is;
    restored on exit. The forward runs on explicit parameters (see the module notes), a
    per-rank task's with ``task`` (:func:`task_active`). The returned block may be entered
    again (and nested) to run on the same tensors."""
    return Rebinding(_assignments(module, mapping), module, task=task)


def rebind_parameters(module: nn.Module, mapping: Mapping[str, Tensor]) -> None:
    """Write each named tensor into ``module`` and keep it there (a differentiable optimiser
    step: the next forward reads the updated, non-leaf tensors through ``named_parameters``,
    ``state_dict`` and the like)."""
    write(_assignments(module, mapping))

