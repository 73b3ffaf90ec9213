"""Where a rank's memory goes: resident memory (now and its high-water mark) and torch's own
allocator figures at named points of a run, so a benchmark can show what each phase costs."""

from __future__ import annotations

import ctypes
import resource
from typing import Any

import torch

MIB = 2**20


def resident_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from ``/proc/self/status`` (Linux); elsewhere
    (0, ``ru_maxrss``). VmHWM is the peak resident memory so far, what ``ru_maxrss`` reports."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        return (
            int(fields["VmRSS"].split()[0]) * 1024,
            int(fields["VmHWM"].split()[0]) * 1024,
        )
    except (OSError, KeyError, ValueError):
        return 0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_free_heap() -> None:
    """Hand the heap pages glibc keeps after tensors are freed back to the kernel
    (``malloc_trim(0)``); a no-op where glibc is absent. Freed CPU tensors below glibc's mmap
    threshold stay resident in its arenas otherwise, and count in the RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


MMAP_THRESHOLD = 256 * 1024  # bytes; glibc's default starts at 128 KiB and rises to 32 MiB
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def limit_heap_fragmentation(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc serve every allocation of ``threshold`` bytes or more (a CPU tensor above
    64K float32 values) with its own ``mmap``, returned to the kernel when freed; True when set.

    glibc raises its mmap threshold to the size of each mapped block freed, up to 32 MiB, so
    after the first step most tensors (activations, FSDP2's per-layer all-gather and
    reduce-scatter buffers, AdamW's temporaries) come from the heap, where freed blocks of
    one step's sizes stay resident while the next step, with other sequence lengths, asks
    for other sizes: the RSS peak grew step by step. Fixing the threshold stops that; each
    large allocation then costs fresh zeroed pages (a few seconds per step on the CPU). No-op
    where glibc is absent."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


class MemoryTrace:
    """Resident memory at named points of a run: ``mark("after wrap")`` records VmRSS, VmHWM
    and, on CUDA, the allocated and peak-allocated bytes of the current device (MiB)."""

    def __init__(self) -> None:
        self.marks: list[dict[str, Any]] = []

    def mark(self, label: str) -> None:
        rss, peak = resident_bytes()
        entry: dict[str, Any] = {
            "label": label,
            "rss_mib": round(rss / MIB, 1),
            "peak_rss_mib": round(peak / MIB, 1),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            entry["cuda_allocated_mib"] = round(torch.cuda.memory_allocated() / MIB, 1)
            entry["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
        self.marks.append(entry)
