"""Resident memory that follows the live tensors: the C allocator's setting metadist applies.

[Note: why metadist sets the allocator]
Under glibc's defaults a freed buffer of a few MiB stays resident: after the first large free
glibc raises its mmap threshold (up to 32 MiB), later buffers come from the heap, and the
heap's freed middle is never returned. A sharded meta-step allocates and frees thousands of
shard-sized tensors (fast weights, their gradients, the update's temporaries), so its
resident memory grew to several times its live tensors and above an unsharded run's, which
is what runs out. Two settings make resident memory follow the tensors:

* glibc's mmap threshold fixed at :data:`THRESHOLD` (4 MiB, two huge pages): every tensor of
  that size or more is mapped on allocation and unmapped when freed;
* torch's CPU allocator asked for transparent huge pages on such tensors
  (``THP_MEM_ALLOC_ENABLE``), so mapping one faults it in 2 MiB at a time instead of 4 KiB.
  (torch aligns such a tensor to a page, not to 2 MiB, so its first and last partial 2 MiB
  still fault in small pages.)

The price is the kernel zeroing each freshly mapped page, which the heap's reuse avoids: small
next to the page faults huge pages save, and paid only by tensors of the threshold's size.
A program that would rather keep that time than the memory turns it off.

Both are applied when metadist is imported (torch reads its setting at its first CPU
allocation, so later would be too late for it), on Linux with glibc only, and in every rank
metadist starts. ``METADIST_ALLOCATOR=default`` in the environment before the import keeps
glibc's and torch's own behaviour. :func:`setting` says what is in force.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

THRESHOLD = 4 << 20
ENV = "METADIST_ALLOCATOR"
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_TORCH_THP = "THP_MEM_ALLOC_ENABLE"

_applied: list[str] = []


def setting() -> str:
    """What resident memory follows in this process, in words (benchmark tables state it)."""
    if os.environ.get(ENV, "").lower() == "default":
        return f"glibc and torch defaults ({ENV}=default)"
    if not _applied:
        return "glibc and torch defaults (not Linux with glibc)"
    return "metadist's: " + ", ".join(_applied)


def apply() -> None:
    """Apply the setting (see the module notes) once, unless turned off."""
    if _applied or os.environ.get(ENV, "").lower() == "default":
        return
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1:
        _applied.append(f"glibc mmap threshold {THRESHOLD >> 20} MiB")
    if os.environ.get(_TORCH_THP) is None:
        os.environ[_TORCH_THP] = "1"  # read by torch at its first CPU allocation
    if os.environ[_TORCH_THP] == "1":  # set here, or inherited from the process that set it
        _applied.append("torch huge pages")
