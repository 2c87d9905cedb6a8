"""Messages a Betty program met that named the wrong cause or a choice Betty rejects (issue
47, item 6).

* A program that sets float64 as torch's default dtype (Betty's examples in float64) was told
  that bf16/fp16 autocast is "not provided" on the CPU, and to use the setting it had chosen:
  the autocast probe built its test tensor in the default dtype, which autocast leaves alone.
* ``logger_type="tensorboard"`` without the package suggested metadist's native loggers
  ("stdout, csv"), which Betty's ``EngineConfig`` rejects.
"""

from __future__ import annotations

import sys

import pytest
import torch

from metadist.testing import run_on_ranks


def _check_under_float64_default() -> str:
    from metadist import precision

    precision._autocast_works.cache_clear()
    torch.set_default_dtype(torch.float64)
    try:
        precision.Precision("bf16-mixed", "cpu").check()
        return "ok"
    except RuntimeError as e:
        return str(e)
    finally:
        torch.set_default_dtype(torch.float32)
        precision._autocast_works.cache_clear()


def test_autocast_probe_ignores_the_default_dtype() -> None:
    assert run_on_ranks(_check_under_float64_default, 1)[0] == "ok"


def test_a_missing_tensorboard_names_bettys_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from metadist.compat.betty.configs import EngineConfig
    from metadist.compat.betty.logging import logger

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not importable
    with pytest.raises(ImportError) as info:
        logger("tensorboard")
    message = str(info.value)
    assert "pip install tensorboard" in message and "'wandb' or 'none'" in message, message
    for suggested in ("wandb", "none"):  # each one Betty's EngineConfig takes
        EngineConfig(logger_type=suggested)
    assert "stdout" not in message and "csv" not in message, message
