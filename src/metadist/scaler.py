"""The dynamic loss scaler of ``precision="16-mixed"``, its skip decision the same on every rank.

Per step it does what torch's ``GradScaler`` does and no more: one fused call per (device,
dtype) group of gradients (``torch._amp_foreach_non_finite_check_and_unscale_``) divides them
by the scale and raises an on-device inf/NaN flag, and the host reads that flag once. The one
addition is the flag's all-reduce over the ranks (a sharded optimizer sees only its own shard;
a rank that skipped alone would desynchronise the replicas, the problem FairScale's
ShardedGradScaler exists for); it is a collective on the device, not a host read.

The results are those of "multiply by ``1 / scale``, then check the unscaled values": the fused
call multiplies by a float32 ``1 / scale`` and checks the values *before* multiplying, which is
the same wherever no finite value can overflow (``scale >= 1``) and the float32 factor gives the
products the plain multiplication gives (float32 gradients; other dtypes where ``1 / scale`` is
exact in float32 and in theirs: the powers of two the default scale keeps). Anything else
multiplies first and checks after, in two passes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer

from metadist.comm import ops

#: The dtypes torch's fused unscale-and-check kernel takes.
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _exact_in(dtype: torch.dtype, value: float) -> bool:
    """Whether ``value`` is exact in float32 and in ``dtype`` (no torch op: no device work)."""
    f32 = struct.pack("<f", value)
    if struct.unpack("<f", f32)[0] != value:
        return False
    if dtype == torch.bfloat16:  # float32 with the low 16 mantissa bits dropped
        return f32[:2] == b"\0\0"
    if dtype == torch.float16:
        try:
            return bool(struct.unpack("<e", struct.pack("<e", value))[0] == value)
        except OverflowError:
            return False
    return True


def _fusable(grad: torch.Tensor, inv: float) -> bool:
    """Whether one fused call gives exactly "multiply by ``inv``, then check" for ``grad``."""
    return (grad.dtype in _FUSED_DTYPES and grad.layout == torch.strided and 0.0 < inv <= 1.0
            and (grad.dtype == torch.float32 or _exact_in(grad.dtype, inv)))


class LossScaler:
    """Dynamic loss scaling whose skip decision is the same on every rank.

    ``scale(loss)`` multiplies the loss before backward. Before ``optimizer.step()`` the
    scaler divides this rank's gradients (those of the tensors the optimizer steps: its shard
    under zero1/2/3) by the scale, checks them for inf/NaN and all-reduces that flag. If any
    rank saw one, every rank skips the step (gradients are set to None, so the optimizer
    leaves parameters and state untouched) and the scale backs off; after
    ``growth_interval`` clean steps in a row it grows.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1
                and init_scale > 0):
            raise ValueError("LossScaler needs init_scale > 0, growth_factor > 1, "
                             "0 < backoff_factor < 1 and growth_interval >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # clean steps since the last change
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._scaled = False  # a scaled backward happened since the last step
        self._unscaled = False  # this step's gradients are already divided by the scale
        # the fused call's factor as a float32 tensor per device, kept while the scale holds
        # (made once per change, not once per step)
        self._factors: dict[tuple[torch.device, float], torch.Tensor] = {}

    # ----- the step ----------------------------------------------------------------------
    def scale(self, loss: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """``loss`` times the scale (and ``share``, this rank's part of the global batch
        where the reducers sum: one factor, one rounding)."""
        self._scaled = True
        return loss * (self.scale_value * share)

    def current_scale(self) -> float:
        """The factor gradients carry right now (1.0 once unscaled)."""
        return 1.0 if self._unscaled else self.scale_value

    @staticmethod
    def _grads(optimizer: Optimizer) -> list[torch.Tensor]:
        return [p.grad for g in optimizer.param_groups for p in g["params"]
                if p.grad is not None]

    @torch.no_grad()
    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide this step's gradients by the scale (idempotent within a step). The step
        still checks them as they are then, so whatever is done to them in between counts."""
        if self._unscaled:
            return
        self._unscale_and_check(optimizer, 1.0 / self.scale_value)
        self._unscaled = True

    @torch.no_grad()
    def _found_inf(self, optimizer: Optimizer) -> bool:
        """Unscale (unless :meth:`unscale_` did) and check; True if any rank saw inf/NaN."""
        if self._unscaled:  # divided already: check only (a factor of 1 leaves them be)
            flag = self._unscale_and_check(optimizer, 1.0)
        else:
            flag = self._unscale_and_check(optimizer, 1.0 / self.scale_value)
            self._unscaled = True
        return self._any_rank(flag)

    def _unscale_and_check(self, optimizer: Optimizer, inv: float) -> torch.Tensor:
        """Multiply the gradients by ``inv``; a one-element float32 tensor, nonzero where a
        gradient holds inf/NaN afterwards. No host read."""
        groups: dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]] = {}
        for g in self._grads(optimizer):
            groups.setdefault((g.device, g.dtype, _fusable(g, inv)), []).append(g)
        flags: dict[torch.device, torch.Tensor] = {}
        for (device, _, fused), grads in groups.items():
            flag = flags.get(device)
            if flag is None:
                flag = flags[device] = torch.zeros(1, device=device)
            if fused:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, flag, self._factor(device, inv))
            else:
                self._multiply_then_check(grads, inv, flag)
        if not flags:  # nothing to check on this rank; it still joins the all-reduce
            return torch.zeros(1, device=self._device(optimizer))
        first, *others = flags.values()
        for other in others:
            first += other.to(first.device)
        return first

    def _multiply_then_check(self, grads: list[torch.Tensor], inv: float,
                             flag: torch.Tensor) -> None:
        """The two-pass form, for what the fused call would compute differently."""
        if inv != 1.0:
            torch._foreach_mul_(grads, inv)
        if all(_fusable(g, 1.0) for g in grads):
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, flag, self._factor(flag.device, 1.0))
        else:  # dtypes or layouts the kernel lacks: a max-abs norm is inf/NaN exactly then
            norms = torch.stack([n.to(flag.device) for n in
                                 torch._foreach_norm(grads, float("inf"))])
            flag.add_(torch.isfinite(norms).logical_not().any())

    def _factor(self, device: torch.device, value: float) -> torch.Tensor:
        key = (device, value)
        factor = self._factors.get(key)
        if factor is None:
            self._factors = {k: v for k, v in self._factors.items() if k[1] == 1.0}
            factor = self._factors[key] = torch.full((1,), value, device=device)
        return factor

    @staticmethod
    def _device(optimizer: Optimizer) -> torch.device:
        for group in optimizer.param_groups:
            for p in group["params"]:
                return torch.device(p.device)
        return torch.device("cpu")

    @staticmethod
    def _any_rank(flag: torch.Tensor) -> bool:
        """Whether any rank's flag is set: the one host read of the step."""
        ops.all_reduce(flag, "max")
        return bool(flag.item() > 0)

    def before_step(self, optimizer: Optimizer) -> None:
        """Unscale, check every rank for inf/NaN and drop this step's gradients if any saw
        one; run before ``optimizer.step()`` on synchronised gradients (the strategy's step
        chain runs it in its ``"unscale"`` phase)."""
        if not self._scaled:
            raise RuntimeError(
                "precision='16-mixed' scales the loss in strategy.backward(loss), but this "
                "step's gradients came from a plain loss.backward(); call "
                "strategy.backward(loss) (or scaler.scale(loss).backward())")
        self.last_step_skipped = self._found_inf(optimizer)
        if self.last_step_skipped:
            for g in optimizer.param_groups:
                for p in g["params"]:
                    p.grad = None  # torch optimizers skip parameters without a gradient

    def after_step(self) -> None:
        """Grow or back off the scale after ``optimizer.step()`` (skipped or not)."""
        self._update(self.last_step_skipped)
        self._scaled = self._unscaled = False

    def _update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale_value *= self.growth_factor
            self.growth_tracker = 0

    @contextmanager
    def unscaled(self, optimizer: Optimizer) -> Iterator[None]:
        """Gradients divided by the scale inside the block (e.g. to inspect them)."""
        self.unscale_(optimizer)
        yield

    # ----- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "growth_tracker": self.growth_tracker, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state lacks {sorted(missing)}; pass the dict saved "
                             "by LossScaler.state_dict()")
        self.scale_value = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def __repr__(self) -> str:
        return (f"LossScaler(scale={self.scale_value:g}, growth_tracker={self.growth_tracker}, "
                f"skipped_steps={self.skipped_steps})")
