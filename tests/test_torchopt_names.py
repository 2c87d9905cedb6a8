"""The TorchOpt drop-in's classes carry TorchOpt 0.7.3's module paths (reprs, messages,
``type(x).__module__``), and their instances still pickle and load without TorchOpt, and as
the drop-in's own classes where TorchOpt is installed."""

from __future__ import annotations

import copy
import importlib
import inspect
import io
import pickle
import pkgutil
from typing import Any

import torch
from torch import nn

import peers
from metadist.compat import torchopt
from metadist.compat.torchopt._names import TORCHOPT_MODULES


def _torchopts_own_paths() -> dict[str, str]:
    """Where TorchOpt itself defines each public class (run where TorchOpt is importable)."""
    peers.use()
    import torchopt as real

    where: dict[str, str] = {}
    for info in pkgutil.walk_packages(real.__path__, "torchopt."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # its optional extras
            continue
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__.startswith("torchopt.") \
                    and not name.startswith("_"):
                where[value.__qualname__] = value.__module__
    return where


def test_the_classes_report_torchopts_module_paths() -> None:
    assert torchopt.MetaAdam.__module__ == "torchopt.optim.meta.adam"
    assert repr(torchopt.MetaAdam) == "<class 'torchopt.optim.meta.adam.MetaAdam'>"
    state = torchopt.adam(0.1).init((torch.ones(2),))
    assert type(state[0]).__module__ == "torchopt.transform.scale_by_adam"
    assert torchopt.nn.MetaGradientModule.__module__ == "torchopt.nn.module"
    assert torchopt.diff.implicit.ImplicitMetaGradientModule.__module__ == \
        "torchopt.diff.implicit.nn.module"
    theirs = peers.run_on(1, _torchopts_own_paths)[0]
    wrong = {name: (path, theirs.get(name)) for name, path in TORCHOPT_MODULES.items()
             if theirs.get(name) != path}
    assert not wrong, f"(drop-in's path, TorchOpt's): {wrong}"


def _round_trip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_instances_pickle_and_load_without_torchopt() -> None:
    """This process cannot import TorchOpt: an optimizer state saved with torch.save loads as
    the drop-in's, equal to what was saved; a meta-optimizer deep-copies as itself. (An
    optimizer holds its transformation's closures, which pickle cannot save: TorchOpt's
    neither.)"""
    params = (torch.linspace(0, 1, 4),)
    opt = torchopt.chain(torchopt.clip_grad_norm(1.0), torchopt.adam(0.1))
    state = opt.init(params)
    _, state = opt.update((torch.ones(4),), state, inplace=False)
    loaded = _round_trip(state)
    assert [type(s) for s in loaded] == [type(s) for s in state]
    assert str(loaded) == str(state)
    empty = torchopt.base.EmptyState()
    assert pickle.loads(pickle.dumps(empty)) == empty
    meta = torchopt.MetaAdam(nn.Linear(3, 2), lr=0.1)
    clone = copy.deepcopy(meta)
    assert type(clone) is torchopt.MetaAdam
    assert str(clone.state_dict()) == str(meta.state_dict())


def _load_beside_torchopt(blob: bytes) -> str:
    peers.use()
    import torchopt as real  # noqa: F401  (TorchOpt is imported, and not what loads)

    state = pickle.loads(blob)
    return f"{type(state[0]).__module__}|{type(state[0]).__qualname__}|" \
           f"{type(state[0]) is torchopt.transform.scalers.ScaleByAdamState}"


def test_a_pickle_loads_as_the_drop_ins_where_torchopt_is_installed() -> None:
    state = torchopt.adam(0.1).init((torch.ones(2),))
    got = peers.run_on(1, _load_beside_torchopt, args=(pickle.dumps(state),))[0]
    assert got == "torchopt.transform.scale_by_adam|ScaleByAdamState|True"
