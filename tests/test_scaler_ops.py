"""The ``16-mixed`` loss scaler does no more work per step than torch's GradScaler.

torch's GradScaler unscales and checks the gradients with one fused call per (device, dtype)
group and reads the overflow flag on the host once per step. These tests count, on CPU, the
aten ops metadist's scaler issues in one step (the ones that read the gradients, and all of
them) and its host synchronisations (``.item()``, ``bool(tensor)``, ``.tolist()``...), next
to GradScaler's on the same model and gradients. Counts, not times: deterministic under load.
On a GPU every one of those ops is a kernel launch and every sync a stall of the host.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import metadist
from metadist.precision import LossScaler
from metadist.testing import OpCount, run_on_ranks
from metadist.testing import count_ops as counted
from parity import batches, loss_fn, make_net


def _grads(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _summary(counts: list[OpCount]) -> dict[str, Any]:
    return {"ops": sum(sum(c.ops.values()) for c in counts),
            "grad_reads": sum(sum(c.reads.values()) for c in counts),
            "syncs": sum(c.syncs for c in counts),
            "by_op": dict(sum((c.ops for c in counts), Counter()))}


def _torch_counts(net: torch.nn.Module, opt: torch.optim.Optimizer,
                  data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, Any]]:
    """GradScaler's ops per step: scale, step (the optimizer's own step left out), update."""
    scaler = torch.amp.GradScaler("cpu")
    real_step = opt.step
    out = []
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(net(x).float(), y)
        with counted([]) as c_scale:
            scaled = scaler.scale(loss)
        scaled.backward()
        with counted(_grads(opt)) as c_step:
            opt.step = lambda *a, **k: None  # type: ignore[method-assign]
            scaler.step(opt)
            opt.step = real_step  # type: ignore[method-assign]
            scaler.update()
        real_step()
        out.append(_summary([c_scale, c_step]))
    return out


@contextmanager
def _counting_scaler(log: list[OpCount], grads: Callable[[Any], list[torch.Tensor]]
                     ) -> Iterator[None]:
    """LossScaler's methods counted (patched on the class before the strategy binds them)."""
    names = ("scale", "before_step", "after_step")
    originals = {n: getattr(LossScaler, n) for n in names}

    def wrap(name: str) -> Callable[..., Any]:
        def call(self: LossScaler, *args: Any) -> Any:
            with counted(grads(args[0]) if name == "before_step" else []) as c:
                result = originals[name](self, *args)
            log.append(c)
            return result
        return call

    try:
        for n in names:
            setattr(LossScaler, n, wrap(n))
        yield
    finally:
        for n, f in originals.items():
            setattr(LossScaler, n, f)


def _metadist_counts(strategy: str, overflow_at: int = -1) -> list[dict[str, Any]]:
    log: list[OpCount] = []
    out = []
    with _counting_scaler(log, _grads):
        s = metadist.strategy(strategy, precision="16-mixed",
                              **({"min_unit_params": 40} if strategy == "zero3" else {}))
        net = make_net(batchnorm=False)
        model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, foreach=True))
        for step, (x, y) in enumerate(batches(3)):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            if step == overflow_at:
                loss = loss * float("inf")
            s.backward(loss)
            opt.step()
            out.append(_summary(log))
            log.clear()
    return out


def _reference_counts() -> list[dict[str, Any]]:
    net = make_net(batchnorm=False)
    return _torch_counts(net, torch.optim.SGD(net.parameters(), lr=0.1, foreach=True),
                         batches(3))


@pytest.mark.parametrize("strategy", ["single", "ddp", "zero3"])
def test_scaler_does_no_more_than_grad_scaler_per_step(strategy: str) -> None:
    """Per step: one pass over the gradients (unscale and check fused), no more ops than
    GradScaler, one host sync (the all-reduced inf flag read once)."""
    want = _reference_counts()
    got = run_on_ranks(_metadist_counts, 1, args=(strategy,))[0]
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["grad_reads"] <= w["grad_reads"] == 1, (step, g, w)
        assert g["syncs"] <= 1, (step, g)
        assert g["ops"] <= w["ops"], (step, g, w)


def _two_groups(seed: int = 0) -> tuple[list[torch.nn.Parameter], torch.Tensor]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3)),
              torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    loss = (params[0].sum(0) * params[1]).sum() + params[2].square().sum().float()
    return params, loss


def test_one_fused_call_per_dtype_group_and_one_sync_like_grad_scaler() -> None:
    """float32 and float64 gradients: two fused calls (torch's per-(device, dtype) groups),
    one host read; the unscaled gradients are GradScaler's bit for bit."""
    run_on_ranks(_one_fused_call_per_group, 1)


def _one_fused_call_per_group() -> None:
    params, loss = _two_groups()
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_opt = torch.optim.SGD(params, lr=0.1)
    torch_scaler.scale(loss).backward()
    with counted(_grads(torch_opt)) as want:
        torch_scaler.unscale_(torch_opt)
        torch_opt.step = lambda *a, **k: None  # type: ignore[method-assign]
        torch_scaler.step(torch_opt)
    torch_grads = [g.clone() for g in _grads(torch_opt)]

    params, loss = _two_groups()
    scaler, opt = LossScaler(), torch.optim.SGD(params, lr=0.1)
    scaler.scale(loss).backward()
    with counted(_grads(opt)) as got:
        scaler.before_step(opt)
    assert got.reads == want.reads == {
        "_amp_foreach_non_finite_check_and_unscale_": 2}
    assert got.syncs == want.syncs == 1
    assert sum(got.ops.values()) <= sum(want.ops.values())
    assert all(torch.equal(a, b) for a, b in zip(_grads(opt), torch_grads, strict=True))


def _stepped(scale: float, dtype: torch.dtype, poke: float | None = None,
             unscale_first: bool = False) -> tuple[list[torch.Tensor], bool]:
    """Gradients (magnitudes 1e-8..1, signs mixed) after the scaler's pre-step work at
    ``scale``, checked against the definition, and whether it skipped."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(256, dtype=dtype))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = LossScaler(init_scale=scale)
    scaler.scale(p.sum() * 0).backward()  # a scaled backward happened
    p.grad = (torch.randn(256, generator=g, dtype=torch.float64)
              * torch.logspace(-8, 0, 256, dtype=torch.float64)).to(dtype)
    if unscale_first:
        scaler.unscale_(opt)
    if poke is not None:
        p.grad[3] = poke
    before = p.grad.clone()
    scaler.before_step(opt)
    if not unscale_first and p.grad is not None:
        torch._foreach_mul_([before], 1.0 / scale)  # the definition: multiply, then check
        assert torch.equal(p.grad, before), (scale, dtype)
    return [p.grad] if p.grad is not None else [], scaler.last_step_skipped


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
@pytest.mark.parametrize("scale", [2.0**16, 3.0, 2.0**30, 1e-3])
def test_unscaled_gradients_are_the_plain_product_in_every_dtype(
        scale: float, dtype: torch.dtype) -> None:
    """Scales whose inverse float32 cannot carry exactly (3.0 in float64/float16), or one
    the fused call would mis-check (below 1), take the two-pass form: the same values."""
    skipped = run_on_ranks(_stepped, 1, args=(scale, dtype))[0][1]
    assert not skipped


def test_a_gradient_that_overflows_when_unscaled_skips_the_step() -> None:
    """Below a scale of 1 unscaling multiplies: a finite gradient can become inf, and the
    check sees the unscaled value (the fused call checks before multiplying: not used)."""
    assert run_on_ranks(_stepped, 1, args=(0.5, torch.float32, 3e38))[0][1]
    assert not run_on_ranks(_stepped, 1, args=(0.5, torch.float32, 1e38))[0][1]


def test_what_is_done_after_unscale_is_checked_at_the_step() -> None:
    """unscale_() early (to inspect or clip), then an inf: the step still sees it."""
    assert run_on_ranks(_stepped, 1, args=(2.0**16, torch.float32, float("inf"), True))[0][1]
    assert not run_on_ranks(_stepped, 1, args=(2.0**16, torch.float32, None, True))[0][1]


def test_the_counts_catch_the_former_two_pass_form() -> None:
    """The test of the test: the former form (multiply, then a max-abs norm per tensor read
    back one by one) makes two passes and a host read per gradient tensor."""
    params, loss = _two_groups()
    loss.backward()
    grads = [p.grad for p in params[:2] if p.grad is not None]  # one float32 group
    with counted(grads) as old:
        torch._foreach_mul_(grads, 2.0**-16)
        norms = torch._foreach_norm(grads, float("inf"))
        bool(not all(torch.isfinite(n).item() for n in norms))
    assert sum(old.reads.values()) == 2 and old.syncs == len(grads) == 2
