"""metadist.compat.torchopt: TorchOpt programs run with only the import changed, with
TorchOpt's signatures, defaults and semantics (numbers checked against TorchOpt 0.7.3 itself,
run from .peers/ in a process of its own)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

import peers
from metadist import meta
from metadist.compat import torchopt
from torchopt_reference.programs import BITWISE, CASES, run

# The drop-in computes with TorchOpt's own arithmetic (Adam's bias corrections included), so
# every case agrees to rounding; none needs a looser tolerance.
LOOSE: set[str] = set()


def _close(got: Any, want: Any, rtol: float, atol: float, where: str) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _close(got[k], want[k], rtol, atol, f"{where}.{k}")
    elif isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, rtol, atol, f"{where}[{i}]")
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=where)


def _torchopts() -> dict[str, Any]:
    peers.use()
    return run("torchopt")


@pytest.fixture(scope="module")
def ours() -> dict[str, Any]:
    return run("compat")


@pytest.fixture(scope="module")
def theirs() -> dict[str, Any]:
    out: dict[str, Any] = peers.run_on(1, _torchopts)[0]
    return out


@pytest.mark.parametrize("case", CASES)
def test_same_numbers_as_torchopt(ours: dict[str, Any], theirs: dict[str, Any],
                                  case: str) -> None:
    """MAML with every meta-optimiser (positional arguments in TorchOpt's order, BatchNorm,
    extract/recover between tasks), sgd's positional weight_decay, apply_updates' in-place
    default, detach_buffers' own storage, FuncOptimizer, chain with clipping and a
    schedule, against TorchOpt 0.7.3 on the same machine. Float64 throughout: the strict
    cases agree to 6e-15 relative (tens of ulps) after three meta-steps of two inner steps;
    1e-10 leaves room for other CPUs' kernels, and no parameter here is rounding noise
    (the conv layer before BatchNorm has no bias). Accelerated Adam's cases (float64 MAML,
    a float32 meta-gradient) are equal bit for bit: the same operations run on both sides,
    on the same machine."""
    want = theirs[case]
    rtol, atol = (2e-6, 1e-6) if case in LOOSE else (1e-10, 1e-12)
    if case in BITWISE:  # use_accelerated_op=True: TorchOpt's operations, in its order
        rtol = atol = 0.0
    _close(ours[case], want, rtol, atol, case)


@pytest.mark.parametrize(("compat", "names"), [
    (torchopt.MetaSGD, ["module", "lr", "momentum", "weight_decay", "dampening", "nesterov",
                        "moment_requires_grad", "maximize"]),
    (torchopt.sgd, ["lr", "momentum", "dampening", "weight_decay", "nesterov",
                    "moment_requires_grad", "maximize"]),
    (torchopt.SGD, ["params", "lr", "momentum", "weight_decay", "dampening", "nesterov",
                    "maximize"]),
    (torchopt.module_clone, ["target", "by", "detach_buffers", "device"]),
    (torchopt.extract_state_dict, ["target", "by", "device", "with_buffers", "detach_buffers",
                                   "enable_visual", "visual_prefix"]),
])
def test_signatures_are_torchopts(compat: Any, names: list[str]) -> None:
    params = [p for p in inspect.signature(compat).parameters if p != "self"]
    assert params == names


def test_native_api_refuses_the_ambiguous_positional_order() -> None:
    """metadist's own MetaSGD/sgd take everything after momentum by keyword: TorchOpt puts
    weight_decay 3rd/4th and torch dampening, so a positional call could silently mean
    another option."""
    net = nn.Linear(2, 1)
    with pytest.raises(TypeError):
        meta.MetaSGD(net, 0.1, 0.9, 0.01)  # type: ignore[misc]
    with pytest.raises(TypeError):
        meta.sgd(0.1, 0.9, 0.0, 0.5)  # type: ignore[misc]


def test_module_clone_aliases_devices_optimisers_and_trees() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    x = torch.randn(4, 2)
    for by, shares, in_graph in [("ref", True, False), ("clone", False, True),
                                 ("deepclone", False, False)]:
        clone = torchopt.module_clone(net, by=by, device="cpu")  # type: ignore[arg-type]
        w = clone[0].weight
        assert (w is net[0].weight) == shares and (w.grad_fn is not None) == in_graph
        assert clone(x).shape == (4, 2)
    opt = torchopt.MetaAdam(net, 0.1)
    opt.step(net(x).sum())
    twin = torchopt.module_clone(opt, by="deepcopy")
    assert isinstance(twin, torchopt.MetaAdam) and twin is not opt
    tree = {"a": torch.ones(2, requires_grad=True)}
    copied = torchopt.module_clone(tree, by="copy")
    assert copied["a"].grad_fn is not None and torch.equal(copied["a"], tree["a"])
    with pytest.raises(ValueError, match="choose one of"):
        torchopt.module_clone(net, by="shallow")  # type: ignore[arg-type]


def test_state_utilities() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    state = torchopt.extract_state_dict(net, by="copy", enable_visual=True, visual_prefix="n.")
    assert isinstance(state, torchopt.ModuleState) and len(state.params) == 2
    # leaves are annotated by name (TorchOpt: tensor -> name; grad_fn -> (name, tensor))
    assert sorted(state.visual_contents.values()) == ["n.0.bias", "n.0.weight", "n.1.bias",
                                                      "n.1.weight"]
    torchopt.stop_gradient(state)
    assert all(t.grad_fn is None for c in state.params for t in c.values())
    opt = torchopt.MetaSGD(net, 0.1, 0.9)
    opt.step(net(torch.ones(3, 2)).sum())
    saved = torchopt.extract_state_dict(opt, by="deepcopy")
    assert isinstance(saved, tuple) and len(saved) == 1  # one state per parameter group
    torchopt.recover_state_dict(opt, saved)
    assert opt.state_dict() == saved
    assert torchopt.module_detach_(net) is net
    assert all(p.grad_fn is None for p in net.parameters())


def test_names_torchopt_programs_use() -> None:
    for name in ["MetaRMSProp", "MetaAdaGrad", "MetaAdaDelta", "MetaAdaMax", "MetaRAdam",
                 "MetaRMSprop", "FuncOptimizer", "chain", "Optimizer", "Adam", "RMSprop",
                 "accelerated_op_available", "ModuleState", "stop_gradient", "module_detach_"]:
        assert hasattr(torchopt, name), name
    adam = torchopt.adam(1e-3, eps_root=1e-8, moment_requires_grad=True, use_accelerated_op=True)
    p = (torch.ones(2, requires_grad=True),)
    state = adam.init(p)
    assert state[0].mu[0].requires_grad  # moment_requires_grad (TorchOpt's chain of states)
    masked = torchopt.adamw(0.1, mask=(False,))
    updates, _ = masked.update((torch.zeros(2),), masked.init(p), params=p)
    assert torch.equal(updates[0], torch.zeros(2))  # no decay where the mask says False
