"""Collectives reached from rank 0's validation (issue 47, item 3).

Betty runs ``validation()`` on rank 0 only, and learning-to-reweight's pattern reads
``self.<problem>.state_dict()`` there. Under "zero" and "fsdp" that state dict was a
collective: the other ranks waited out the collective timeout and reported programs that
diverged, naming neither validation nor ``state_dict``. Now:

* the module's part comes from validation's local copy (the current weights), and where the
  optimizer's state is whole on every rank ("distributed") the call gives rank 0 what one
  process's does;
* where the optimizer's state is spread over the ranks, the call stops at once, on every
  rank, naming ``state_dict()`` in validation and what to write instead;
* any metadist collective reached from validation stops at once the same way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import metadist
import peers
from metadist.errors import RankFailedError


def _state_in_validation(strategy: str) -> dict[str, Any]:
    peers.use()
    from betty_programs.overrides import run

    seen: dict[str, Any] = {}

    def validation(engine: Any) -> dict[str, Any]:
        state = engine.inner.state_dict()
        seen["module"] = {k: v.clone() for k, v in state["module"].items()}
        seen["optimizer"] = state["optimizer"]
        return {"ok": 1.0}

    run("compat", strategy, override=False, train_iters=10, valid_step=10,
        validation=validation)
    return seen


@pytest.mark.parametrize("strategy", ["distributed", "fsdp"])
def test_state_dict_in_validation_is_one_process_s_where_the_state_is_whole(strategy: str
                                                                            ) -> None:
    """The program's inner optimizer is plain SGD: its state is empty, whole on every rank
    under "fsdp" too; the module's weights come from validation's copy."""
    want = peers.run_on(1, _state_in_validation, ("default",))[0]
    got = peers.run_on(2, _state_in_validation, (strategy,))[0]  # rank 0 validates
    assert got["module"].keys() == want["module"].keys()
    for key, value in want["module"].items():
        torch.testing.assert_close(got["module"][key], value, rtol=1e-9, atol=1e-12)
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["optimizer"]["state"] == want["optimizer"]["state"] == {}


@pytest.mark.parametrize("strategy", ["zero"])
def test_state_dict_in_validation_stops_at_once_where_the_state_is_spread(strategy: str
                                                                          ) -> None:
    """Before: every rank waited the collective timeout, then "the ranks' programs
    diverged"."""
    with pytest.raises(RankFailedError) as info:
        peers.run_on(2, _state_in_validation, (strategy,))
    message = str(info.value)
    assert "state_dict() in validation()" in message, message
    assert f"strategy {strategy!r}" in message and "self.inner.module.state_dict()" in message
    assert "timeout" not in message.split("state_dict() in validation()", maxsplit=1)[0], message


def _collective_in_validation() -> str:
    peers.use()
    from betty_programs.overrides import run

    def validation(engine: Any) -> dict[str, Any]:
        metadist.comm.all_reduce(torch.ones(1))
        return {}

    try:
        run("compat", "distributed", override=False, train_iters=10, valid_step=10,
            validation=validation)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_collective_in_validation_stops_at_once_on_every_rank() -> None:
    out = peers.run_on(2, _collective_in_validation, ())
    for rank, message in enumerate(out):  # rank 1 learns it from rank 0's broadcast
        assert "validation() failed on rank 0" in message, (rank, message)
        assert "metadist.comm.all_reduce is a collective, called from validation(), which " \
               "runs on rank 0 only" in message, (rank, message)
