"""metadist.compat.fairscale, measured by FairScale programs with only their imports changed
(tests/fairscale_programs/): each starts its own ranks with mp.spawn on a process group it
initialises itself, as FairScale's users do. The drop-in on N ranks equals its one process on
the same global batch (fp32 parity tolerances, >= 10 steps), and its one process equals
FairScale 0.4.13's (installed beside the package in .peers/ by the test set-up), run on the
CPU where FairScale runs there (its FSDP needs CUDA).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import metadist
from metadist.runtime.spawn import free_port
from parity import ATOL, RTOL
from peers import PEERS

PROGRAMS = Path(__file__).resolve().parent / "fairscale_programs"


def _run(tmp_path: Path, program: str, library: str, world_size: int,
         *flags: str) -> dict[str, Any]:
    """Run a program as its own job (it spawns its ranks); what rank 0 saved."""
    out = tmp_path / f"{program}-{library}-{world_size}{''.join(flags)}.pt"
    env = dict(os.environ, LIBRARY=library)
    if library == "fairscale":  # only FairScale's runs see the peers
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PEERS), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(PROGRAMS / f"{program}.py"), str(world_size),
                           str(free_port()), str(out), *flags], env=env, timeout=300,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, (f"{program} on {library} at {world_size} rank(s) failed:\n"
                                  f"{done.stderr[-4000:]}")
    saved: dict[str, Any] = torch.load(out, weights_only=False)
    return saved


def _state_tensors(optimizer_state: dict[str, Any]) -> list[torch.Tensor]:
    return [v for _, per in sorted(optimizer_state["state"].items()) for _, v in
            sorted(per.items()) if isinstance(v, torch.Tensor)]


def _assert_equal_runs(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert list(got["model"]) == list(want["model"]), where
    for name, value in want["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")
    got_state, want_state = _state_tensors(got["optimizer"]), _state_tensors(want["optimizer"])
    assert len(got_state) == len(want_state) > 0, where
    for i, (a, b) in enumerate(zip(got_state, want_state, strict=True)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, i=i: f"{where} optimizer state {i}: {m}")
    assert [p["lr"] for p in got["optimizer"]["param_groups"]] == \
        [p["lr"] for p in want["optimizer"]["param_groups"]], where
    # norms: a float32 sum of squares over the ranks' parts, in another order than one
    # process's; the same tolerances as the parameters
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]),
                               rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} norms: {m}")


def test_oss_and_sharded_ddp_equal_one_process_and_fairscale(tmp_path: Path) -> None:
    """The seed's OSS + ShardedDDP program (an LR scheduler on the OSS, OSS.clip_grad_norm,
    consolidate_state_dict, model.module): on 2 and 3 ranks as one process; one process's
    and 2 ranks' as FairScale's own."""
    one = _run(tmp_path, "oss_sharded_ddp", "metadist", 1)
    assert one["keys"][:2] == ["module.0.weight", "module.0.bias"]  # FairScale's names
    fairscale = {n: _run(tmp_path, "oss_sharded_ddp", "fairscale", n) for n in (1, 2)}
    _assert_equal_runs(one, fairscale[1], "one process vs FairScale's")
    for n in (2, 3):
        got = _run(tmp_path, "oss_sharded_ddp", "metadist", n)
        _assert_equal_runs(got, one, f"{n} ranks vs one process")
        if n in fairscale:
            _assert_equal_runs(got, fairscale[n], f"{n} ranks vs FairScale's {n} ranks")


def test_freezing_a_layer_after_setup_equals_one_process(tmp_path: Path) -> None:
    """requires_grad_(False) on a layer between epochs, then refresh_trainable(): the ranks
    go on as one process does (metadist reads requires_grad at every backward)."""
    one = _run(tmp_path, "oss_sharded_ddp", "metadist", 1, "--freeze")
    _assert_equal_runs(_run(tmp_path, "oss_sharded_ddp", "metadist", 3, "--freeze"), one,
                       "frozen layer, 3 ranks vs one process")


def test_nested_fsdp_with_wrap_utilities_equals_one_process(tmp_path: Path) -> None:
    """enable_wrap/wrap/auto_wrap units inside a root FSDP, Adam built afterwards on
    model.parameters(), FSDP.clip_grad_norm_, a full state dict under the user's names and
    gather_full_optim_state_dict: on 3 ranks (and 2 without resharding) as one process."""
    one = _run(tmp_path, "fsdp_nested", "metadist", 1)
    plain = ["embed.weight", "embed.bias", "blocks.0.fc1.weight", "blocks.0.fc1.bias"]
    assert list(one["model"])[:4] == plain and one["names"][:4] == plain
    _assert_equal_runs(_run(tmp_path, "fsdp_nested", "metadist", 3), one, "fsdp 3 ranks")
    _assert_equal_runs(_run(tmp_path, "fsdp_nested", "metadist", 2, "--reshard-off"), one,
                       "fsdp 2 ranks, reshard_after_forward=False")


def test_checkpoint_wrapper_and_sharded_grad_scaler_equal_one_process_and_fairscale(
        tmp_path: Path) -> None:
    """The seed's second program: checkpoint_wrapper(offload_to_cpu=True) and
    ShardedGradScaler, on OSS + ShardedDDP. One process's equals FairScale's (whose scaler
    disables itself without CUDA; the drop-in's scales by a power of two, which changes no
    float32 number); 3 ranks equal one process."""
    one = _run(tmp_path, "checkpoint_scaler", "metadist", 1, "--offload")
    _assert_equal_runs(one, _run(tmp_path, "checkpoint_scaler", "fairscale", 1, "--offload"),
                       "one process vs FairScale's")
    _assert_equal_runs(_run(tmp_path, "checkpoint_scaler", "metadist", 3, "--offload"), one,
                       "3 ranks vs one process")


# ----- what the drop-in refuses, by name (one process) ---------------------------------------
@pytest.fixture
def one_process() -> Any:
    was = metadist.is_initialized()
    metadist.init()
    yield
    if not was:
        metadist.shutdown()


def test_options_the_drop_in_cannot_honour_are_named(one_process: Any) -> None:
    from metadist.compat.fairscale.nn import FullyShardedDataParallel, ShardedDataParallel
    from metadist.compat.fairscale.optim import OSS

    net = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="broadcast_fp16=True"):
        OSS(net.parameters(), lr=0.1, broadcast_fp16=True)
    with pytest.raises(ValueError, match=r"move_grads_to_cpu=False.*move_params_to_cpu"):
        FullyShardedDataParallel(net, move_params_to_cpu=True, move_grads_to_cpu=False)
    with pytest.raises(ValueError, match="force_input_to_fp32"):
        FullyShardedDataParallel(net, force_input_to_fp32=True)
    oss = OSS(net.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(\) on every rank"):
        oss.state_dict()
    with pytest.raises(ValueError, match="filter_params_fn"):
        oss.clip_grad_norm(1.0, filter_params_fn=lambda ps: ps)
    with pytest.raises(TypeError, match="one OSS optimizer per model"):
        ShardedDataParallel(net, [oss, OSS(net.parameters(), lr=0.1)])


def test_nested_units_must_share_the_roots_options(one_process: Any) -> None:
    from metadist.compat.fairscale.nn import FullyShardedDataParallel as Fsdp

    model = Fsdp(nn.Sequential(Fsdp(nn.Linear(4, 4), move_params_to_cpu=True),
                               nn.Linear(4, 1)))
    with pytest.raises(ValueError, match=r"cpu_offload=True.*outermost instance's"):
        list(model.parameters())


# ----- a collective call made on one rank ------------------------------------------------------
def _state_dict_on_rank_zero_only() -> None:
    from metadist.compat.fairscale.nn import FullyShardedDataParallel

    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    if metadist.world().rank == 0:
        model.module.state_dict()  # a FairScale habit: collective under zero3
    model(torch.randn(2, 4)).sum().backward()


def test_a_state_dict_on_rank_zero_only_is_named_collective() -> None:
    """``if rank == 0: model.module.state_dict()`` under zero3: the timeout names the call
    and says it is collective (before: only that rank 1 did not arrive, and to raise the
    limit). Whichever rank reports, rank 0's collective carries the call's name."""
    with pytest.raises(metadist.RankFailedError) as info:
        metadist.launch(_state_dict_on_rank_zero_only, 2, timeout=120, collective_timeout=3,
                        threads=1)
    text = str(info.value)
    assert "in state_dict() of a model sharded by zero3/hsdp" in text, text


def _summon() -> tuple[dict[str, tuple[int, ...]], dict[str, float]]:
    from metadist.compat.fairscale.nn import FullyShardedDataParallel, enable_wrap, wrap

    torch.manual_seed(0)
    with enable_wrap(wrapper_cls=FullyShardedDataParallel):
        net = nn.Sequential(wrap(nn.Linear(4, 4)), nn.Linear(4, 1))
    model = FullyShardedDataParallel(net)
    before = model.state_dict()
    with model.summon_full_params():
        shapes = {n: tuple(p.shape) for n, p in model.module.named_parameters()}
        with torch.no_grad():
            model.module[1].weight.add_(1.0)
    after = model.state_dict()
    return shapes, {k: float((after[k] - before[k]).abs().max()) for k in before}


def test_summon_full_params_shows_whole_parameters_and_keeps_writes() -> None:
    for shapes, changed in metadist.launch(_summon, 2, timeout=120, threads=1):
        assert shapes == {"0.module.weight": (4, 4), "0.module.bias": (4,),
                          "1.weight": (1, 4), "1.bias": (1,)}
        assert changed == {"0.weight": 0.0, "0.bias": 0.0, "1.weight": 1.0, "1.bias": 0.0}
