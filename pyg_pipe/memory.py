"""Peak memory of one process over a stretch of work, net of what it held when the stretch began.

This is what the strategies report per rank (``strategy.peak_memory``, bytes, one entry per rank, for
the whole ``fit``) and what to compare with one process training the plain model:

* on a GPU: ``torch.cuda.max_memory_allocated`` since the start (the peak statistics are reset
  there), minus what was allocated at the start;
* on a CPU: the kernel's resident-set high-water mark (``VmHWM``), reset at the start by writing
  ``5`` to ``/proc/self/clear_refs`` (Linux 4.0 and later), minus the resident size at the start
  (after ``malloc_trim`` hands freed memory back, so memory freed before is not reused unseen).
  What a process held before (the libraries, the graph, the model) is not counted, so a run and a
  single-process reference that load the same data compare their training memory. Where the mark
  cannot be reset, the lifetime peak is used (an upper bound) and ``exact`` is ``False``.
"""
from __future__ import annotations

import os
import resource
from typing import Optional

import torch


class PeakMemory:
    """Measures the net peak memory of this process from :meth:`start` on.

    Args:
        device: the process's device (``cuda`` devices use the CUDA allocator's statistics).
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.base = 0
        self.exact = True

    def start(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            trim()  # memory freed earlier but kept by malloc would be reused unseen: hand it back first
            self.base = _resident()
            self.exact = _reset_high_water_mark()
        return self

    def in_use(self) -> int:
        """What the process holds now beyond what it held at :meth:`start` (allocated on a GPU, resident on a
        CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device) - self.base)
        return _resident() - self.base

    def net_bytes(self) -> int:
        """The peak since :meth:`start`, net of the memory held at the start."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device) - self.base)
        return max(_high_water_mark() - self.base, 0)


def trim() -> None:
    """Hands the memory glibc's malloc keeps after frees back to the system (a no-op elsewhere)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _high_water_mark() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
