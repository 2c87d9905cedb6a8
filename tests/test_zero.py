"""zero1, zero2, zero3/fsdp and hsdp: parity with one process, state dicts, accumulation,
memory at the ZeRO formulas, and the zero3 machinery (units, prefetch, dtypes)."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.strategies.zero import balanced_partition
from metadist.strategies.zero3.strategy import ShardedModule
from metadist.strategies.zero3.wrap import plan_units
from metadist.testing import run_on_ranks, unique_storage_bytes
from parity import (
    ATOL,
    RTOL,
    assert_parity,
    batches,
    local_batch,
    loss_fn,
    make_net,
    make_optimizer,
    reference,
    shard,
    train_on_rank,
)

# zero3/hsdp with tiny units so the parity model is split into many (every Linear its own).
SHARDED = {
    "zero1": {},
    "zero2": {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.0005},  # several owners' buckets
    "zero3": {"min_unit_params": 40},
    "fsdp": {"min_unit_params": 40, "reshard_after_forward": False, "prefetch": False},
}


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_sharded_strategies_match_single_process(strategy: str, n: int, optimizer: str) -> None:
    # 531 parameters: world sizes 2 and 4 do not divide it (padding), 3 does
    want = reference(optimizer, world=n)
    out = run_on_ranks(train_on_rank, n, args=(strategy, optimizer, 1, True, SHARDED[strategy]))
    for rank, got in enumerate(out):
        assert_parity(got, want, f"{strategy} n={n} rank={rank} {optimizer}")


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", sorted(SHARDED))
def test_gradient_accumulation_with_no_sync(strategy: str, n: int, optimizer: str) -> None:
    want = reference(optimizer, accumulate=2, world=n)
    for got in run_on_ranks(train_on_rank, n,
                            args=(strategy, optimizer, 2, True, SHARDED[strategy])):
        assert_parity(got, want, f"{strategy} n={n} {optimizer} accumulate=2")


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize(("n", "nnodes"), [(4, 2), (2, 2), (3, 1)])
def test_hsdp_matches_single_process(n: int, nnodes: int, accumulate: int) -> None:
    # 2 nodes x 2 ranks: shard within a node, replicate across nodes
    for optimizer in ("sgd", "adam", "adamw"):
        want = reference(optimizer, accumulate, world=n)
        out = run_on_ranks(train_on_rank, n, nnodes=nnodes,
                           args=("hsdp", optimizer, accumulate, True, {"min_unit_params": 40}))
        for rank, got in enumerate(out):
            assert_parity(got, want, f"hsdp n={n} nnodes={nnodes} rank={rank} {optimizer} "
                                     f"accumulate={accumulate}")


# ----- state dicts ------------------------------------------------------------------------

def _train(strategy: metadist.Strategy, model: Any, opt: torch.optim.Optimizer,
           steps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    w = metadist.world()
    for x, y in steps:
        opt.zero_grad()
        strategy.backward(loss_fn(model(shard(x, w.rank, w.world_size)),
                                  shard(y, w.rank, w.world_size)))
        opt.step()


def _resume(strategy: str, options: dict[str, Any], full: dict[str, Any] | None
            ) -> dict[str, Any]:
    """Train 5 steps, save full model/optimizer state, then 5 more; or resume from ``full``."""
    data = batches()
    s = metadist.strategy(strategy, sync_batchnorm=True, **options)
    net = make_net()
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    if full is None:
        _train(s, model, opt, data[:5])
        # state_dict() returns live tensors for replicated strategies (as torch does): copy
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                 "optim": s.optimizer_state_dict(opt), "shard": opt.state_dict()}
    else:
        model.load_state_dict(full["model"])
        opt.load_state_dict(full["optim"])
        saved = {}
    _train(s, model, opt, data[5:])
    return {"saved": saved, "final": model.state_dict()}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_state_dicts_round_trip_and_reshard(strategy: str) -> None:
    options = SHARDED[strategy]
    straight = run_on_ranks(_resume, 2, args=(strategy, options, None))
    full = straight[0]["saved"]
    # the consolidated optimizer state is the plain single-process format
    plain = make_optimizer("adam", make_net().parameters())
    plain.load_state_dict(full["optim"])
    assert len(full["optim"]["state"]) == 6  # every trained parameter, unused branch excluded
    # a shard is local and tagged; the full dict loads at another world size
    assert "metadist_shard" in straight[0]["saved"]["shard"]
    for n in (2, 3):
        resumed = run_on_ranks(_resume, n, args=(strategy, options, {
            "model": full["model"], "optim": full["optim"]}))
        for got in resumed:
            for k, v in straight[0]["final"].items():
                torch.testing.assert_close(got["final"][k], v, rtol=RTOL, atol=ATOL)


def _wrong_shard() -> str:
    s = metadist.strategy("zero1")
    net = make_net()
    _, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    sd = opt.state_dict()
    sd["metadist_shard"] = "owner/9/0/[]"
    try:
        opt.load_state_dict(sd)
    except ValueError as err:
        return str(err)
    return ""


def test_loading_a_shard_of_another_layout_says_how_to_save() -> None:
    assert "optimizer_state_dict" in run_on_ranks(_wrong_shard, 2)[0]


# ----- memory at the ZeRO formulas --------------------------------------------------------

def _memory(strategy: str) -> dict[str, int]:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(128, 128) for _ in range(12)])
    psize = sum(p.numel() * 4 for p in net.parameters())
    options = {"min_unit_params": 10_000, "prefetch": False} if strategy == "zero3" else {}
    s = metadist.strategy(strategy, **options)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    x = torch.randn(8, 128)
    measured: dict[str, int] = {}

    def measure() -> None:
        params = [*model.parameters(), *[getattr(m, n) for m in net.modules()
                                         for n in ("weight", "bias") if hasattr(m, n)]]
        if isinstance(model, ShardedModule):
            params = [*model.parameters(), *[f.full for f in model.flats]]  # freed: 0 bytes
        grads = [p.grad for p in model.parameters()]
        state = [v for st in opt.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim() > 0]
        measured.update(P=unique_storage_bytes(params), G=unique_storage_bytes(grads),
                        O=unique_storage_bytes(state), Psize=psize)

    for step in range(2):
        opt.zero_grad(set_to_none=False)
        if step == 1 and strategy == "zero3":  # peak: one unit gathered, shards + grads + state
            handle = net[5].register_forward_pre_hook(lambda *_: measure())
        model(x).square().mean().backward()
        opt.step()
    if strategy == "zero3":
        handle.remove()
    else:
        measure()
    return measured


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_per_rank_memory_matches_the_zero_formulas(strategy: str, n: int) -> None:
    for got in run_on_ranks(_memory, n, args=(strategy,)):
        p = got["Psize"]
        g, o = p, 2 * p  # Adam: two moments
        unit = p // 12  # one Linear(128, 128)
        want = {"ddp": p + g + o, "zero1": p + g + o / n, "zero2": p + (g + o) / n,
                "zero3": (p + g + o) / n + unit}[strategy]
        total = got["P"] + got["G"] + got["O"]
        assert abs(total - want) <= 0.05 * want, f"{strategy} n={n}: {got} vs {want:.0f}"


# ----- zero3 machinery --------------------------------------------------------------------

def test_wrap_policy_by_size_classes_and_fusion() -> None:
    mlp = nn.Sequential(nn.Linear(100, 100), nn.GELU(), nn.Linear(100, 100), nn.Linear(100, 2))
    units = plan_units(mlp, min_params=5_000)
    assert [len(u.params) for u in units] == [2, 2, 2]  # two Linears, then the root's head
    assert units[-1].is_root and units[-1].params[0][3] == "3.weight"
    small = nn.Sequential(*[nn.Linear(10, 10) for _ in range(6)])  # 110 params each
    fused = plan_units(small, min_params=300)
    assert [len(u.modules) for u in fused[:-1]] == [3, 3]  # adjacent small layers fused
    around = nn.Sequential(nn.Linear(1, 40), nn.Tanh(), nn.Linear(40, 40), nn.Linear(40, 1))
    # a unit in between ends a run: the small ends are not fused across it (root keeps them)
    assert [len(u.params) for u in plan_units(around, min_params=100)] == [2, 4]
    block = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))
    by_class = plan_units(block, min_params=1, classes=(nn.Sequential,))
    assert [u.modules[0] for u in by_class[:-1]] == [block[0]]
    tied = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    tied[1].weight = tied[0].weight
    units = plan_units(tied, min_params=1)
    assert [fqn for *_, fqn in units[-1].params] == ["0.weight", "1.weight"]  # tied: root


def test_balanced_partition_is_contiguous_and_balanced() -> None:
    assert balanced_partition([4, 4, 4, 4, 1], 2) == [0, 0, 1, 1, 1]
    # the largest share (5) is the least possible; the rest is split evenly, not 5 + 0
    assert balanced_partition([5, 1, 1, 1, 1, 1], 3) == [0, 1, 1, 1, 2, 2]
    assert balanced_partition([1] * 10, 3) == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert len(set(balanced_partition([1, 1], 4))) == 2  # fewer items than ranks
    assert balanced_partition([], 3) == []
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # the largest share is the least any contiguous split achieves
        sizes = torch.randint(0, 9, (int(torch.randint(1, 7, (), generator=g)),),
                              generator=g).tolist()
        parts = int(torch.randint(1, 4, (), generator=g))
        owners = balanced_partition(sizes, parts)
        assert owners == sorted(owners) and all(0 <= o < parts for o in owners)
        loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r)
                 for r in range(parts)]
        cuts = itertools.combinations_with_replacement(range(len(sizes) + 1), parts - 1)
        best = min(max(sum(sizes[a:b]) for a, b in itertools.pairwise([0, *c, len(sizes)]))
                   for c in cuts)
        assert max(loads) == best, (sizes, parts, owners)


def _uneven(strategy: str, overlap: bool) -> tuple[int, int, list[float]]:
    """A 3-layer MLP whose middle weight (1 MiB of 1.52) is the whole share of one of three
    owners: per-rank parameter bytes, P, and parameters after two steps."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                        nn.Linear(512, 10))
    psize = sum(p.numel() * p.element_size() for p in net.parameters())
    s = metadist.strategy(strategy, overlap_param_gather=overlap)
    model, opt = s.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(s.world.rank))
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    model.wait_params()
    return (unique_storage_bytes(model.parameters()), psize,
            [p.sum().item() for p in model.parameters()])


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_an_uneven_partition_still_holds_parameters_once(strategy: str, overlap: bool) -> None:
    out = run_on_ranks(_uneven, 3, args=(strategy, overlap))
    for held, psize, params in out:
        assert held == psize, f"{held / 2**20:.3f} MiB of parameters, P = {psize / 2**20:.3f}"
        assert params == out[0][2]  # every rank refreshed from the owners


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_blocking_refresh_matches_single_process(strategy: str) -> None:
    # 531 parameters at world size 3: owners' regions of different sizes
    want = reference("adam", world=3)
    options = {**SHARDED[strategy], "overlap_param_gather": False}
    for got in run_on_ranks(train_on_rank, 3, args=(strategy, "adam", 1, True, options)):
        assert_parity(got, want, f"{strategy} overlap_param_gather=False")


# Every way a program reaches a parameter without passing through the wrapper's waits.
_DIRECT_READS: dict[str, Any] = {
    "module._parameters": lambda inner, kept: [
        m._parameters[k].clone() for m in inner.modules() for k in m._parameters],
    "named_parameters of the user's module": lambda inner, kept: [
        p.clone() for _, p in inner.named_parameters()],
    "p.data of a parameter kept from before": lambda inner, kept: [p.data.clone() for p in kept],
    "tensor detached before the step": lambda inner, kept: [p.detach().clone() for p in kept],
    "deep copy": lambda inner, kept: [p.clone() for p in copy.deepcopy(inner).parameters()],
    "state_dict": lambda inner, kept: [t.clone() for t in inner.state_dict().values()],
}


def _reads_right_after_step(strategy: str) -> list[str]:
    """Each path read first thing after its own optimizer step (4 MiB of parameters: an
    asynchronous refresh would still be on its way), against the values once every refresh
    has landed; returns the paths that saw something else (learn2learn's clone_module reads
    ``module._parameters`` this way)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512))
    s = metadist.strategy(strategy)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    kept = list(net.parameters())
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(s.world.rank))
    stale = []
    for path, read in _DIRECT_READS.items():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen = read(net, kept)
        model.wait_params()
        settled = [p.detach().clone() for p in net.parameters()]
        if any(not torch.equal(a, b) for a, b in zip(seen, settled, strict=True)):
            stale.append(path)
    return stale


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_no_read_after_step_sees_a_pre_step_value(strategy: str) -> None:
    for stale in run_on_ranks(_reads_right_after_step, 2, args=(strategy,)):
        assert stale == [], f"{strategy}: read pre-step values through {stale}"


def _bf16_training() -> tuple[str, float]:
    net = make_net(batchnorm=False)
    s = metadist.strategy("zero3", min_unit_params=40, param_dtype="bfloat16",
                          reduce_dtype="float32")
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    dtypes = set()
    x, y = batches(1)[0]
    w = metadist.world()
    out = model(shard(x.bfloat16(), w.rank, w.world_size))
    dtypes.add(str(out.dtype))
    loss = loss_fn(out.float(), shard(y, w.rank, w.world_size))
    s.backward(loss)
    opt.step()
    return ",".join(sorted(dtypes | {str(p.dtype) for p in model.parameters()})), loss.item()


def test_param_dtype_computes_in_bfloat16_and_keeps_fp32_shards() -> None:
    for dtypes, loss in run_on_ranks(_bf16_training, 2):
        assert dtypes == "torch.bfloat16,torch.float32" and loss > 0


def _tied_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 8), nn.Tanh(), nn.Linear(8, 10, bias=False))
    net[2].weight = net[0].weight
    s = metadist.strategy("zero3", min_unit_params=1)
    model, opt = s.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    tokens = torch.arange(10)
    for _ in range(3):
        opt.zero_grad()
        w = metadist.world()
        part = tokens[w.rank * 5:(w.rank + 1) * 5]
        s.backward(nn.functional.cross_entropy(model(part), part))
        opt.step()
    return model.state_dict()


def test_tied_weights_train_like_one_process() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 8), nn.Tanh(), nn.Linear(8, 10, bias=False))
    net[2].weight = net[0].weight
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(net(torch.arange(10)), torch.arange(10)).backward()
        opt.step()
    for got in run_on_ranks(_tied_weights, 2):
        torch.testing.assert_close(got["0.weight"], net[0].weight.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got["2.weight"], net[0].weight.detach(), rtol=RTOL, atol=ATOL)


def _clip(strategy: str) -> float:
    s = metadist.strategy(strategy, **SHARDED.get(strategy, {}))
    net = make_net(batchnorm=False)
    model, _ = s.setup(net, make_optimizer("sgd", net.parameters()))
    xs, ys = local_batch()
    s.backward(loss_fn(model(xs), ys))
    return s.clip_grad_norm_(model, 1e9).item()


def test_clip_grad_norm_is_the_global_norm_for_every_strategy() -> None:
    net = make_net(batchnorm=False)
    x, y = batches(1)[0]
    loss_fn(net(x), y).backward()
    want = torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None]).norm()
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        for got in run_on_ranks(_clip, 3, args=(strategy,)):
            assert got == pytest.approx(want.item(), rel=1e-5), strategy


def _offload_observed(cpu_offload: bool, breakage: str) -> dict[str, Any]:
    """Where zero3 keeps shards, gradients and optimizer state, and which copies setup made.

    On CPU the offload copy is ``shard.cpu()`` of a tensor already there (tests/test_gpu.py
    runs compute on cuda), so the path is observed instead: ``Tensor.cpu`` is watched during
    setup, and each shard the optimizer steps must be what that copy returned (its storage),
    with the flat's ``offload`` set. ``breakage`` disables the path (the test of the test):
    "flag_dropped" builds the flats without offload; "copy_skipped" keeps the flag but skips
    the copy."""
    from metadist.strategies.zero3.flat import FlatParam

    copied: list[torch.Tensor] = []  # what Tensor.cpu() returned during setup (kept alive,
    # so that no later tensor can reuse one of their addresses)
    cpu, init = torch.Tensor.cpu, FlatParam.__init__

    def watched_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = cpu(self, *args, **kwargs)
        copied.append(out)
        return out

    def broken_init(flat: FlatParam, *args: Any, **kwargs: Any) -> None:
        init(flat, *args, **{**kwargs, "offload": False})
        if breakage == "copy_skipped":
            flat.offload = True

    torch.Tensor.cpu = watched_cpu  # type: ignore[method-assign]
    if breakage:
        FlatParam.__init__ = broken_init  # type: ignore[method-assign]
    try:
        net = make_net()
        s = metadist.strategy("zero3", min_unit_params=40, cpu_offload=cpu_offload,
                              sync_batchnorm=True)
        model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    finally:
        torch.Tensor.cpu, FlatParam.__init__ = cpu, init  # type: ignore[method-assign]
    x, y = local_batch()
    s.backward(loss_fn(model(x), y))
    opt.step()
    storages = {t.untyped_storage().data_ptr() for t in copied}
    flats = [f for f in model.flats if f.shard.requires_grad]
    stepped = [p for g in opt.param_groups for p in g["params"]]
    return {
        "offload": [f.offload for f in model.flats],
        "copied": [f.shard.untyped_storage().data_ptr() in storages for f in model.flats],
        "optimizer steps the shards": [any(p is f.shard for p in stepped) for f in flats],
        "shards": {f.shard.device.type for f in model.flats},
        "grads": {f.shard.grad.device.type for f in flats if f.shard.grad is not None},
        "state": {v.device.type for f in flats for v in opt.state[f.shard].values()
                  if torch.is_tensor(v)},
        "compute": {f.full.device.type for f in model.flats},
    }


def test_cpu_offload_keeps_shards_on_the_cpu_and_matches() -> None:
    # On a CPU-only machine compute is on the CPU as well: the placement is checked and the
    # offload copy's path observed; tests/test_gpu.py covers compute on a GPU with shards,
    # gradients and optimizer state in (pinned) host memory.
    for got in run_on_ranks(_offload_observed, 2, args=(True, "")):
        n = len(got["offload"])
        assert n > 1 and all(got["optimizer steps the shards"]), got
        assert got["shards"] == got["grads"] == got["state"] == {"cpu"}, got
        assert got["compute"] == {metadist.strategy("zero3").device.type}, got
        assert got["offload"] == got["copied"] == [True] * n, got
    for got in run_on_ranks(_offload_observed, 2, args=(False, "")):
        assert not any(got["offload"]) and not any(got["copied"]), got  # no offload, no copy
    want = reference("adam", world=2)
    options = {"min_unit_params": 40, "cpu_offload": True}
    for got in run_on_ranks(train_on_rank, 2, args=("zero3", "adam", 1, True, options)):
        assert_parity(got, want, "zero3 cpu_offload")


@pytest.mark.parametrize("breakage", ["flag_dropped", "copy_skipped"])
def test_cpu_offload_check_fails_with_the_path_disabled(breakage: str) -> None:
    """The test of the test above: with the offload path disabled its path check fails."""
    for got in run_on_ranks(_offload_observed, 2, args=(True, breakage)):
        assert not all(got["copied"]), got
        assert got["offload"] == [breakage == "copy_skipped"] * len(got["offload"]), got


def _groups_schedule_frozen(strategy: str | None) -> dict[str, torch.Tensor]:
    """Two param groups with their own hyperparameters, an LR scheduler built on the user's
    optimizer before setup, and a frozen layer."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    net[0].requires_grad_(False)
    weights = [p for n, p in net.named_parameters() if n.endswith("weight") and p.requires_grad]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias") and p.requires_grad]
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1},
                             {"params": biases, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model: Any = net
    s = None
    if strategy is not None:
        options = {"min_unit_params": 10} if strategy == "zero3" else {}
        s = metadist.strategy(strategy, **options)
        model, opt = s.setup(net, opt)
    g = torch.Generator().manual_seed(7)
    for _ in range(10):
        x, y = torch.randn(12, 6, generator=g), torch.randn(12, 2, generator=g)
        if s is not None:
            x, y = shard(x, s.world.rank, s.world.world_size), shard(y, s.world.rank,
                                                                     s.world.world_size)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        sched.step()
    assert opt.param_groups[1]["lr"] == 5e-3 * 0.5**3
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_param_groups_schedulers_and_frozen_layers(strategy: str) -> None:
    want = _groups_schedule_frozen(None)
    for got in run_on_ranks(_groups_schedule_frozen, 3, args=(strategy,)):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k: f"{k}: {m}")


def _consolidate_on_rank_one(strategy: str) -> tuple[bool, int]:
    s = metadist.strategy(strategy, **SHARDED[strategy])
    net = make_net(batchnorm=False)
    model, opt = s.setup(net, make_optimizer("adam", net.parameters()))
    xs, ys = local_batch()
    s.backward(loss_fn(model(xs), ys))
    opt.step()
    full = s.optimizer_state_dict(opt, to=1)
    return full is None, len(full["state"]) if full is not None else -1


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_consolidating_onto_one_rank(strategy: str) -> None:
    out = run_on_ranks(_consolidate_on_rank_one, 3, args=(strategy,))
    assert [none for none, _ in out] == [True, False, True]
    assert out[1][1] == 4  # inp and out weights and biases; the unused branch has no state
