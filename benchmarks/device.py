"""Where the benchmarks compute: ``--device {auto,cpu,cuda}`` and what differs on a GPU.

The CPU path is the one the README's figures come from and must not move: under ``cpu``
(and ``auto`` without a GPU) every helper here does what the benchmarks did before it
existed. On ``cuda`` the ranks get one GPU each over NCCL, clocks wait for the GPU, and
memory is the CUDA allocator's count.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

import metadist

DEVICES = ("auto", "cpu", "cuda")
_chosen: dict[str, Any] = {}  # what resolve() saw before it hid the GPUs (if it did)


def add_args(ap: argparse.ArgumentParser, world: bool = True) -> None:
    """``--device`` (and ``--world``, whose default follows it) of the benchmarks that run
    on a GPU: ddp, zero, precision, meta and real_models."""
    ap.add_argument("--device", choices=DEVICES, default="auto",
                    help="where the ranks compute: auto (cuda when a GPU is visible), cpu "
                         "(gloo, GPUs hidden from the ranks) or cuda (NCCL, one GPU per rank)")
    if world:
        ap.add_argument("--world", type=int, default=None,
                        help="ranks (default 2 on the CPU, one per GPU on cuda)")


def resolve(args: argparse.Namespace) -> str:
    """``args.device`` as 'cpu' or 'cuda' (and a missing ``args.world`` filled in). Under
    'cpu' the ranks started afterwards see no GPU, so metadist gives them the CPU and gloo as
    on a machine without one; under 'cuda' each rank gets its own GPU and NCCL."""
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    if args.device == "cuda" and not cuda:
        raise SystemExit(f"--device cuda: no CUDA GPU is visible to torch {torch.__version__} "
                         f"(CUDA build: {torch.version.cuda or 'none'}); run with --device cpu "
                         "or auto, or on a machine with a GPU")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu"
    if "world" in vars(args) and args.world is None:
        args.world = gpus if device == "cuda" else 2
    world = vars(args).get("world") or 1
    if device == "cuda" and world > gpus:
        raise SystemExit(f"--world {world} on --device cuda needs one GPU per rank and {gpus} "
                         f"{'is' if gpus == 1 else 'are'} visible: pass --world {gpus} or less "
                         "(or --device cpu)")
    _chosen.update(device=device, cuda_available=cuda, gpus=gpus,
                   cuda_device=torch.cuda.get_device_name(0) if cuda else None)
    if device == "cpu" and cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read by the ranks spawned from here on
    args.device = device
    return device


def environment() -> dict[str, Any]:
    """The device fields of a benchmark's ``environment`` in results.json."""
    if _chosen.get("device") == "cuda":
        return {"device": "cuda", "backend": "nccl", "cuda_available": True,
                "cuda_device": _chosen["cuda_device"], "gpus": _chosen["gpus"],
                "cuda": torch.version.cuda}
    if _chosen:
        cuda, name = _chosen["cuda_available"], _chosen["cuda_device"]
    else:  # a benchmark without --device: the CPU, as always
        cuda = torch.cuda.is_available()
        name = torch.cuda.get_device_name(0) if cuda else None
    return {"device": "cpu", "backend": "gloo", "cuda_available": cuda, "cuda_device": name}


@contextlib.contextmanager
def cpu_ranks() -> Iterator[None]:
    """Ranks started inside see no GPU: for a part that runs on the CPU whatever
    ``--device`` says (Betty's, whose harness shims are CPU-only)."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def where(world: int | None = None) -> str:
    """How the ranks ran, for a table's heading: 'gloo, 1 thread per rank' on the CPU (the
    words the CPU headings always had), NCCL and the GPU's name on cuda."""
    if _chosen.get("device") != "cuda":
        return "gloo, 1 thread per rank"
    return f"NCCL, {'one' if world == 1 else 'a'} {_chosen['cuda_device']} per rank"


def on_cuda() -> bool:
    """Whether this rank computes on a GPU (its world's device; False outside a job)."""
    return metadist.is_initialized() and metadist.world().device.type == "cuda"


def here() -> torch.device:
    """This rank's device: where models and batches go before a step."""
    return metadist.world().device


def synchronize(cuda: bool) -> None:
    """Wait for this rank's queued GPU work: a CUDA call returns before its kernels finish,
    so a clock read without this measures the launches, not the step. No-op on the CPU."""
    if cuda:
        torch.cuda.synchronize()


def kept_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), bytes)`` that ``fn`` leaves allocated (a forward's activations): storages on
    the CPU, the CUDA allocator's count on a GPU (what runs out there)."""
    from metadist.testing import bytes_kept_by

    if not on_cuda():
        return bytes_kept_by(fn)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.memory_allocated() - before


def step_peak(fn: Callable[[], object]) -> int | None:
    """Bytes above what was allocated before that ``fn`` (one step) reached at its peak, by
    ``torch.cuda.max_memory_allocated``: that configuration's activations and transient
    buffers, though every configuration lives in the same process. None on the CPU (the
    benchmarks count storages there)."""
    if not on_cuda():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def ddp(model: torch.nn.Module) -> torch.nn.Module:
    """torch's DistributedDataParallel of ``model`` on this rank's device (its GPU given as
    ``device_ids`` on cuda, as torch's docs do)."""
    from torch.nn.parallel import DistributedDataParallel

    if not on_cuda():
        return DistributedDataParallel(model)
    dev = here()
    return DistributedDataParallel(model.to(dev), device_ids=[dev.index])
