"""Torch habits on a set-up model: state dicts behave exactly as the plain module's.

Every strategy's model, its ``model.module``, a submodule, the model inside another module
and ``torch.compile(model)`` are compared with the same calls on a plain torch module built
from the same seed: keys in order, values, ``prefix``/``destination``/``keep_vars``,
non-persistent buffers, missing/unexpected keys and torch's error messages on loading, and
the forward after a load. Reproductions of issue 18: under zero3 a nested or compiled
model's ``state_dict()`` was ``{}``, ``model.module.state_dict()`` held the buffers only,
non-persistent buffers were saved, and a plain state dict did not load.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.strategies.dp import DataParallelModule
from metadist.strategies.registry import available
from metadist.testing import run_on_ranks

D = 8
# Tiny units: zero3/hsdp split the model into several flats, some of them uneven over 3 ranks.
OPTIONS: dict[str, dict[str, Any]] = {
    "single": {}, "ddp": {}, "zero1": {},
    "zero2": {"bucket_cap_mb": 0.0001, "first_bucket_mb": 0.0001},
    "zero3": {"min_unit_params": 10}, "hsdp": {"min_unit_params": 10},
}
# (strategy, ranks, nodes): hsdp 4 is 2 nodes x 2 ranks (sharded within, replicated across)
CELLS = [("single", 1, 1), ("ddp", 3, 1), ("zero1", 3, 1), ("zero2", 3, 1), ("zero3", 2, 1),
         ("zero3", 3, 1), ("hsdp", 3, 1), ("hsdp", 4, 2)]


class Block(nn.Module):
    """A direct parameter after its children, BatchNorm buffers (num_batches_tracked), and
    a non-persistent buffer (as HF BERT's position_ids)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D)
        self.register_buffer("position_ids", torch.arange(D, dtype=torch.float32),
                             persistent=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x) * self.scale) + 0.01 * self.position_ids)


class Net(nn.Module):
    """Nested blocks, a frozen layer, a parameter registered as None, tied weights and a
    non-persistent buffer at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.head = nn.Linear(D, 3, bias=False)
        self.tied = nn.Linear(D, 3, bias=False)
        self.tied.weight = self.head.weight
        self.register_buffer("token_type_ids", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        h = self.frozen(h)
        return self.head(h) + self.tied(h) + self.token_type_ids


class Outer(nn.Module):
    """A user module that holds the set-up model (as a parent module of a trainer would)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.extra = nn.Linear(2, 2)
        self.inner = inner


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()  # eval: forwards read the running statistics, never update them


def _shifted(state: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {k: v + (int(by) if not v.is_floating_point() else by) for k, v in state.items()}


def _entries(state: dict[str, Any]) -> list[tuple[str, torch.Tensor, bool]]:
    """Keys in order with values (detached copies) and requires_grad."""
    return [(k, v.detach().clone(), v.requires_grad) for k, v in state.items()]


def _load(module: nn.Module, state: dict[str, Any], strict: bool = True) -> Any:
    """torch's result of a load: the (missing, unexpected) keys, or the error message."""
    try:
        keys = module.load_state_dict(state, strict=strict)
    except RuntimeError as exc:
        return str(exc)
    return (list(keys.missing_keys), list(keys.unexpected_keys))


def _calls(model: nn.Module, user: nn.Module, x: torch.Tensor,
           ) -> dict[str, Any]:
    """The same calls on ``model`` (the set-up one, or the plain one) and on ``user`` (its
    ``model.module``, or the plain one again)."""
    out: dict[str, Any] = {}
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["state_dict"] = _entries(model.state_dict())
    out["module.state_dict"] = _entries(user.state_dict())
    out["submodule"] = _entries(user.blocks[1].state_dict())
    out["keep_vars"] = _entries(model.state_dict(keep_vars=True))
    destination: dict[str, Any] = {"earlier": torch.ones(1)}
    returned = model.state_dict(destination=destination, prefix="p.")
    out["destination"] = (returned is destination, _entries(destination))
    outer = Outer(model)
    out["nested"] = _entries(outer.state_dict())
    compiled = torch.compile(model)
    out["compiled"] = _entries(compiled.state_dict())

    # Loads: strict, non-strict with missing and unexpected keys, a size mismatch; each
    # followed by a forward, which must compute with the loaded values.
    partial = _shifted(base, 1.0)
    del partial["blocks.0.lin.weight"], partial["blocks.1.norm.running_mean"]
    partial["blocks.0.position_ids"] = torch.zeros(D)  # non-persistent: unexpected
    partial["bogus"] = torch.zeros(1)
    wrong = dict(base)
    wrong["embed.weight"] = torch.zeros(4, D)
    loads: list[tuple[str, Callable[[], Any]]] = [
        ("strict", lambda: _load(model, _shifted(base, 0.5))),
        ("partial strict", lambda: _load(model, partial)),
        ("partial", lambda: _load(model, partial, strict=False)),
        ("size mismatch", lambda: _load(model, wrong)),
        ("module", lambda: _load(user, _shifted(base, 0.25))),
        ("submodule", lambda: _load(user.blocks[0], _shifted(user.blocks[0].state_dict(), 2.0))),
        ("nested", lambda: _load(outer, _shifted(outer.state_dict(), 0.125))),
        ("nested partial", lambda: _load(outer, {f"inner.{k}": v for k, v in partial.items()},
                                         strict=False)),
        ("nested strict", lambda: _load(outer, {f"inner.{k}": v for k, v in partial.items()})),
        ("compiled", lambda: _load(compiled, _shifted(compiled.state_dict(), 0.0625))),
        ("compiled partial", lambda: _load(
            compiled, {f"_orig_mod.{k}": v for k, v in partial.items()}, strict=False)),
    ]
    for name, call in loads:
        with torch.no_grad():
            out[f"load {name}"] = (call(), _entries(model.state_dict()), model(x))
    return out


def _on_rank(strategy: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    net = _net()
    model = metadist.strategy(strategy, **options).setup_module(net)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(x)  # zero3: units gathered and freed, the root unit left gathered
    plain = _net()
    return _calls(model, model.module, x), _calls(plain, plain, x)


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=where)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize(("strategy", "n", "nodes"), CELLS)
def test_state_dicts_behave_as_the_plain_modules(strategy: str, n: int, nodes: int) -> None:
    results = run_on_ranks(_on_rank, n, args=(strategy, OPTIONS[strategy]), nnodes=nodes,
                           timeout=300)
    for rank, (got, want) in enumerate(results):
        assert got.keys() == want.keys()
        for call in want:
            _assert_same(got[call], want[call], f"{strategy} n={n} rank {rank}: {call}")


def test_dp_module_state_dicts_behave_as_the_plain_modules() -> None:
    # "dp" needs two GPUs to set up; its module's state-dict code is what these calls run.
    # (No forward: DataParallelModule scatters to GPUs.)
    model, plain = DataParallelModule(_net(), [0]), _net()
    for build in (lambda m: m, Outer, torch.compile):
        ours, theirs = build(model), build(plain)
        _assert_same(_entries(ours.state_dict()), _entries(theirs.state_dict()), "dp")
        shifted = _shifted(theirs.state_dict(), 1.0)
        _assert_same(_load(ours, shifted), _load(theirs, shifted), "dp load")
        _assert_same(_entries(ours.state_dict()), _entries(theirs.state_dict()), "dp loaded")


def _assign(strategy: str, options: dict[str, Any]) -> str:
    model = metadist.strategy(strategy, **options).setup_module(_net())
    try:
        model.load_state_dict(_net().state_dict(), assign=True)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_assign_is_refused_under_zero3_and_loads_elsewhere() -> None:
    assert run_on_ranks(_assign, 2, args=("ddp", {})) == ["loaded"] * 2
    for message in run_on_ranks(_assign, 2, args=("zero3", OPTIONS["zero3"])):
        assert "assign=True" in message and "assign=False" in message


def _in_param_dtype() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    s = metadist.strategy("zero3", min_unit_params=10, param_dtype="bfloat16")
    model = s.setup_module(_net())  # computes in bfloat16; the shards stay float32
    return model.state_dict(), _net().state_dict()


def test_state_dict_values_are_the_shards_not_their_param_dtype_copies() -> None:
    # Reproduction: the state dict was gathered in param_dtype, rounding every parameter.
    for got, want in run_on_ranks(_in_param_dtype, 2):
        _assert_same(list(got.items()), list(want.items()), "param_dtype=bfloat16")


def _full_checkpoint(strategy: str, options: dict[str, Any], path: str) -> None:
    s = metadist.strategy(strategy, **options)
    net = _net()
    model, optimizer = s.setup(net, torch.optim.SGD(
        [p for p in net.parameters() if p.requires_grad], lr=0.1))
    s.save(path, {"model": model, "optimizer": optimizer}, format="full")


@pytest.mark.parametrize("strategy", ["zero3", "hsdp"])
def test_full_checkpoint_loads_into_a_plain_model_strictly(strategy: str,
                                                            tmp_path: Path) -> None:
    path = tmp_path / "full.pt"
    run_on_ranks(_full_checkpoint, 3, args=(strategy, OPTIONS[strategy], str(path)))
    saved = torch.load(path, weights_only=True)["model"]
    plain = _net()
    keys = plain.load_state_dict(saved, strict=True)
    assert not keys.missing_keys and not keys.unexpected_keys
    want = plain.state_dict()
    assert list(saved) == list(want)
    for key, value in want.items():
        assert torch.equal(saved[key], value), key


# ----- one option vocabulary -----------------------------------------------------------
ZERO3_SCRIPT = {"min_unit_params": 10, "wrap_classes": (Block,), "param_dtype": None,
                "reshard_after_forward": True, "cpu_offload": False}


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    from metadist.strategies import options

    monkeypatch.setattr(options, "_WARNED", set())


@pytest.mark.usefixtures("fresh_warnings")
def test_switching_strategy_keeps_the_options_and_warns_once_per_ignored_one() -> None:
    # Reproduction: metadist.strategy("ddp", param_dtype=None, wrap_classes=...) raised.
    with pytest.warns(UserWarning) as caught:
        for name in available():  # aliases too (fsdp, distributed, default, zero)
            metadist.strategy(name, **ZERO3_SCRIPT)
        metadist.strategy("ddp", **ZERO3_SCRIPT)  # a second time: no second warning
    messages = sorted(str(w.message) for w in caught)
    # zero3/fsdp/hsdp use them all; the others ignore the two that are not "off"
    ignored = [(s, o) for s in ("single", "dp", "ddp", "zero1", "zero2")
               for o in ("min_unit_params=10", "wrap_classes=(")]
    assert len(messages) == len(ignored), messages
    for strategy, option in ignored:
        assert any(m.startswith(f"strategy {strategy!r} ignores option {option}")
                   and "only zero3, hsdp use it" in m for m in messages), (strategy, option)


@pytest.mark.usefixtures("fresh_warnings")
@pytest.mark.parametrize(("name", "options"), [
    ("ddp", {"param_dtype": None, "wrap_classes": (), "min_unit_params": 100_000,
             "prefetch": False, "cpu_offload": False}),
    ("zero3", {"bucket_cap_mb": 25.0, "broadcast_buffers": False,
               "overlap_param_gather": False}),
    ("single", {"bucket_cap_mb": 25, "overlap_param_gather": False}),
])
def test_options_meaning_off_are_accepted_silently(name: str, options: dict[str, Any]) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metadist.strategy(name, **options)


@pytest.mark.usefixtures("fresh_warnings")
def test_an_ignored_option_names_the_strategies_that_use_it() -> None:
    with pytest.warns(UserWarning, match=r"strategy 'zero3' ignores option "
                                         r"bucket_cap_mb=50: only ddp, zero1, zero2 use it"):
        metadist.strategy("fsdp", bucket_cap_mb=50)
    with pytest.warns(UserWarning, match=r"'ddp' ignores option cpu_offload=True: "
                                         r"only zero3, hsdp use it"):
        metadist.strategy("distributed", cpu_offload=True)


def test_ignored_options_are_still_checked_and_unknown_ones_raise() -> None:
    with pytest.raises(TypeError, match=r"param_dtype must be a string or a torch.dtype or "
                                        r"None"):
        metadist.strategy("ddp", param_dtype=3)
    with pytest.raises(ValueError, match=r"min_unit_params must be >= 1"):
        metadist.strategy("ddp", min_unit_params=0)
    with pytest.raises(ValueError, match="dtype"):
        metadist.strategy("single", param_dtype="bfloat17")
    with pytest.raises(ValueError, match=r"strategy 'ddp' has no option\(s\) 'bucket_mb', and no "
                                         r"other strategy has; valid options: .*bucket_cap_mb.*"
                                         r"\(other strategies' options, .*min_unit_params"):
        metadist.strategy("ddp", bucket_mb=3)
