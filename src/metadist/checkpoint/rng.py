"""Random number generator states, saved per rank and restored on load, and compared.

Saved: Python's ``random``, numpy's global generator (when numpy is importable), torch's CPU
generator and, when CUDA is initialised, every CUDA device's. Every rank's state is kept.

On load, rank r restores the state saved by rank r; when the checkpoint was written by fewer
ranks (a larger world on resume) ranks beyond them take rank 0's. Ranks then draw the same
random numbers as rank 0 (e.g. identical dropout masks); reseed them
(``torch.manual_seed(seed + rank)``) after loading if that matters.

The meta engine compares them too (:func:`digests`): what rank 0's validation draws reaches
every rank whose generators were rank 0's (meta/engine.py).
"""

from __future__ import annotations

import hashlib
import pickle
import random
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """This process's generator states, in types a ``weights_only`` load accepts."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        saved: Any = np.random.get_state()  # legacy tuple: (kind, keys, pos, has_gauss, gauss)
        kind, keys, pos, has_gauss, gauss = saved
        # numpy arrays are not in weights_only's allow-list: keep the key as a torch tensor
        state["numpy"] = {"kind": str(kind), "key": torch.from_numpy(keys.astype(np.int64)),
                          "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}
    # is_initialized: saving must not start CUDA in a process that never used it
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def digests(state: dict[str, Any]) -> dict[str, str]:
    """A short fingerprint of each generator in ``state`` (from :func:`capture`): equal
    fingerprints, equal generators; cheap to send where states only need comparing."""
    out = {}
    for key, part in state.items():
        h = hashlib.sha256()
        if key == "python":
            h.update(pickle.dumps(part))
        elif key == "numpy":
            h.update(part["key"].numpy().tobytes())
            h.update(repr((part["kind"], part["pos"], part["has_gauss"], part["gauss"])).encode())
        else:  # torch's tensor, CUDA's list of them
            for t in part if isinstance(part, list) else [part]:
                h.update(t.numpy().tobytes())
        out[key] = h.hexdigest()
    return out


def pick(states: list[dict[str, Any]], rank: int) -> dict[str, Any] | None:
    """The state rank ``rank`` restores: its own, or rank 0's when the saving world was smaller."""
    if not states:
        return None
    return states[rank] if rank < len(states) else states[0]


def restore(state: dict[str, Any] | None) -> None:
    """Set this process's generators to ``state`` (from :func:`capture`)."""
    if state is None:
        return
    python = state.get("python")
    if python is not None:
        version, internal, gauss = python
        random.setstate((version, tuple(internal), gauss))
    if state.get("torch") is not None:
        torch.set_rng_state(state["torch"])
    saved_np = state.get("numpy")
    if saved_np is not None:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.set_state((saved_np["kind"], saved_np["key"].numpy().astype(np.uint32),
                                 saved_np["pos"], saved_np["has_gauss"], saved_np["gauss"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        count = min(len(cuda), torch.cuda.device_count())
        for device in range(count):
            torch.cuda.set_rng_state(cuda[device], device)
