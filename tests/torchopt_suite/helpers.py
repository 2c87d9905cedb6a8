"""Stand-in for TorchOpt 0.7.3's ``tests/helpers.py``, which its source distribution does not
ship: the constants, the model factory and the comparison functions its test files call
(``helpers.get_models``, ``parametrize``, ``assert_*_all_close``, ...), written for this
project from what those files expect of them.

The model has, as the suite's tests assume, a parameter-free softmax head, BatchNorm layers with
running statistics, and a submodule and a parameter that take no part in the forward pass (so
their gradients stay ``None``).
"""

from __future__ import annotations

import copy
import itertools
import os
import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils import data

BATCH_SIZE = 64
NUM_UPDATES = 5
MODEL_NUM_INPUTS = 28 * 28
MODEL_NUM_CLASSES = 10
MODEL_HIDDEN_SIZE = 64


def dtype_numpy2torch(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(1, dtype=dtype)).dtype


def dtype_torch2numpy(dtype: torch.dtype) -> np.dtype:
    return np.dtype(torch.empty(1, dtype=dtype).numpy().dtype)


def parametrize(**argvalues: Any) -> Any:
    """The cartesian product of the given values; with a ``dtype`` argument, only the first
    dtype gets the whole product and every further dtype runs the product's first case."""
    names = list(argvalues)
    if "dtype" in names:
        dtypes = list(argvalues["dtype"])
        names.remove("dtype")
        names.insert(0, "dtype")
        rest = [list(argvalues[n]) for n in names[1:]]
        cases = [(dtypes[0], *combo) for combo in itertools.product(*rest)]
        cases += [(d, *cases[0][1:]) for d in dtypes[1:]]
    else:
        cases = list(itertools.product(*(list(argvalues[n]) for n in names)))
    ids = ["-".join(f"{n}({v})" for n, v in zip(names, case, strict=True)) for case in cases]
    return pytest.mark.parametrize(names, cases, ids=ids)


def seed_everything(seed: int) -> None:
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)


class MyLinear(nn.Module):
    """A linear layer beside a submodule and a parameter that the forward pass never uses."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias, device=device,
                                dtype=dtype)
        self.unused_module = nn.Linear(1, 1, bias=False)
        self.unused_parameter = nn.Parameter(torch.zeros(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@torch.no_grad()
def get_model() -> nn.Module:
    hidden = MODEL_HIDDEN_SIZE
    return nn.Sequential(
        MyLinear(MODEL_NUM_INPUTS, hidden),
        nn.BatchNorm1d(hidden, track_running_stats=True),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.BatchNorm1d(hidden, track_running_stats=True),
        nn.ReLU(),
        nn.Linear(hidden, MODEL_NUM_CLASSES, bias=False),
        nn.Softmax(dim=-1),
    )


@torch.no_grad()
def get_models(device: Any = None, dtype: torch.dtype = torch.float32
               ) -> tuple[nn.Module, nn.Module, nn.Module, data.DataLoader]:
    """Three identical models (to optimise, to optimise with the reference, the start) and a
    loader of ``NUM_UPDATES`` batches."""
    seed_everything(42)
    base = get_model().to(dtype=dtype)
    for name, p in base.named_parameters():
        if name.endswith("weight") and p.ndim >= 2:
            nn.init.orthogonal_(p)
        if name.endswith("bias"):
            p.normal_(0.0, 0.1)
    model, model_ref = copy.deepcopy(base), copy.deepcopy(base)
    if device is not None:
        target = torch.device(device)
        base, model, model_ref = (m.to(device=target) for m in (base, model, model_ref))
    n = BATCH_SIZE * NUM_UPDATES
    dataset = data.TensorDataset(torch.randint(0, 1, (n, MODEL_NUM_INPUTS)),
                                 torch.randint(0, MODEL_NUM_CLASSES, (n,)))
    return model, model_ref, base, data.DataLoader(dataset, BATCH_SIZE, shuffle=False)


@torch.no_grad()
def assert_all_close(actual: torch.Tensor, expected: torch.Tensor,
                     base: torch.Tensor | None = None, rtol: float | None = None,
                     atol: float | None = None, equal_nan: bool = False) -> None:
    """``assert_close`` of the two (relative to ``base`` if given); without tolerances,
    torch's defaults for the dtype widened by ``5 * NUM_UPDATES``."""
    if base is not None:
        actual, expected = actual - base, expected - base
    if rtol is None or atol is None:
        from torch.testing._comparison import get_tolerances

        rtol, atol = get_tolerances(actual, expected, rtol=rtol, atol=atol)
        rtol, atol = rtol * 5 * NUM_UPDATES, atol * 5 * NUM_UPDATES
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=equal_nan,
                               check_dtype=True)


@torch.no_grad()
def assert_model_all_close(model: Any, model_ref: nn.Module, model_base: nn.Module,
                           dtype: torch.dtype = torch.float32, rtol: float | None = None,
                           atol: float | None = None, equal_nan: bool = False) -> None:
    """Every parameter and buffer of ``model`` (a module, or ``(params, buffers)``) against
    ``model_ref``'s, relative to ``model_base``'s; integer buffers compared as ``dtype``."""
    params: Iterable[torch.Tensor]
    buffers: Iterable[torch.Tensor]
    if isinstance(model, tuple):
        params, buffers = model
    else:
        params, buffers = model.parameters(), model.buffers()
    for p, ref, start in zip(params, model_ref.parameters(), model_base.parameters(), strict=False):
        assert_all_close(p, ref, base=start, rtol=rtol, atol=atol, equal_nan=equal_nan)
    for triple in zip(buffers, model_ref.buffers(), model_base.buffers(), strict=False):
        b, ref, start = (t if t.is_floating_point() else t.to(dtype=dtype) for t in triple)
        assert_all_close(b, ref, base=start, rtol=rtol, atol=atol, equal_nan=equal_nan)


@torch.no_grad()
def assert_pytree_all_close(actual: Any, expected: Any, base: Any = None,
                            rtol: float | None = None, atol: float | None = None,
                            equal_nan: bool = False) -> None:
    """Leaf by leaf :func:`assert_all_close` of two trees of the same structure."""
    from torchopt import pytree  # the run's torchopt: TorchOpt's or the compat layer's

    got, spec = pytree.tree_flatten(actual)
    want, want_spec = pytree.tree_flatten(expected)
    assert spec == want_spec
    bases: list[Any] = [None] * len(got)
    if base is not None:
        bases, base_spec = pytree.tree_flatten(base)
        assert base_spec == want_spec
    for a, e, b in zip(got, want, bases, strict=True):
        assert_all_close(a, e, base=b, rtol=rtol, atol=atol, equal_nan=equal_nan)
