"""Where the history's |V|-row buffers live: the device, host memory, or files on disk.

=========== ==================================================================================
``device``  ordinary tensors on the rank's device (the default)
``host``    CPU tensors (pinned when the device is a GPU); reads gather rows on the host and copy
            them to the device, writes copy a chunk's rows back. On a CPU run this is the device.
``disk``    memory-mapped files in ``offload_dir`` (a temporary directory by default), one per
            buffer; after every access to a buffer its pages are handed back to the kernel
            (``madvise(MADV_DONTNEED)``: the data stays in the file and the page cache, the
            process stops holding it), so a run's resident memory holds at most one buffer's
            pages at a time, not the buffers, and buffers larger than the machine's memory work
=========== ==================================================================================

A byte budget (``offload_budget``) keeps buffers on the device while they fit and puts the rest in
the tier: an int, or ``"auto"`` (half the memory the device has free when the first buffer is made:
``torch.cuda.mem_get_info`` on a GPU, ``MemAvailable`` on a CPU). Values are the same in every tier;
only where the bytes sit changes, so results are identical to the all-device run.
"""
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from typing import Dict, Optional, Union

import torch
from torch import Tensor

OFFLOAD_TIERS = (None, "host", "disk")


class Tiers:
    """Allocates history buffers on the device or in the offload tier, within the budget.

    Args:
        device: the rank's device.
        offload: ``None`` (everything on the device), ``"host"`` or ``"disk"``.
        budget: bytes the device may hold before buffers go to the tier (``None``: none, every
            buffer goes to the tier; ``"auto"``: from free memory).
        directory: where ``disk`` files go (``None``: a temporary directory, removed at exit).
    """

    def __init__(self, device: torch.device, offload: Optional[str] = None,
                 budget: Union[None, int, str] = None, directory: Optional[str] = None):
        self.device, self.offload, self.budget, self.directory = device, offload, budget, directory
        self.on_device = 0                      # bytes of buffers kept on the device
        self._maps: Dict[int, mmap.mmap] = {}    # storage address -> its mapping
        self._device: Dict[int, int] = {}        # storage address -> bytes, of buffers counted on the device
        self._tmp: Optional[str] = None
        self._count = 0
        self._side = None                        # the side stream of :meth:`fetch` (a GPU's)

    def zeros(self, shape, dtype: torch.dtype) -> Tensor:
        """A zero buffer, on the device while the budget allows, else in the tier."""
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        if self.offload is None or self.on_device + nbytes <= self._budget():
            self.on_device += nbytes
            t = torch.zeros(shape, dtype=dtype, device=self.device)
            self._device[t.untyped_storage().data_ptr()] = nbytes
            return t
        if self.offload == "host":  # (pinned where it is made: one pass over the bytes, not three)
            return torch.zeros(shape, dtype=dtype, pin_memory=self.device.type == "cuda")
        return self._mapped(shape, dtype, nbytes)

    def offloads(self, shape, dtype: torch.dtype) -> bool:
        """Whether a buffer :meth:`zeros` made now would go to the tier."""
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        return self.offload is not None and self.on_device + nbytes > self._budget()

    def copy(self, t: Tensor) -> Tensor:
        """A copy of ``t`` in the same kind of place a new buffer would get."""
        out = self.zeros(t.shape, t.dtype)
        out.copy_(t)
        self.release(out)
        return out

    def free(self, t: Tensor) -> None:
        """``t`` (a buffer from :meth:`zeros`) is no longer used: its device bytes return to the budget, its
        file goes when the last tensor on it does. Tensors from elsewhere are ignored."""
        ptr = t.untyped_storage().data_ptr()
        self.on_device -= self._device.pop(ptr, 0)
        self._maps.pop(ptr, None)

    def evict(self) -> None:
        """Hands every disk buffer's resident pages back to the kernel."""
        for m in self._maps.values():
            m.madvise(mmap.MADV_DONTNEED)

    def release(self, *buffers: Tensor) -> None:
        """Hands the pages of ``buffers`` back to the kernel if they are disk buffers (after an access)."""
        if self._maps:
            for t in buffers:
                m = self._maps.get(t.untyped_storage().data_ptr())
                if m is not None:
                    m.madvise(mmap.MADV_DONTNEED)

    def to_device(self, rows: Tensor) -> Tensor:
        return rows if rows.device == self.device else rows.to(self.device, non_blocking=True)

    def in_tier(self, t: Tensor) -> bool:
        """Whether ``t`` (a buffer from :meth:`zeros`) is in the offload tier, not on the device."""
        return self.offload is not None and t.untyped_storage().data_ptr() not in self._device

    def staging(self, shape, dtype: torch.dtype) -> Tensor:
        """A host buffer rows are gathered into on their way to the device: pinned on a GPU (so the copy to the
        device runs asynchronously; PyTorch's pinned-memory cache keeps it until that copy is done)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")

    def fetch(self, buf: Tensor, start: int, end: int, halo: Tensor) -> tuple:
        """Starts copying ``[buf[start:end] | buf[halo]]`` of tier buffer ``buf`` to the device ahead of its use
        (``halo``: ids where ``buf`` is). On a GPU the copy runs on a side stream, with an event :meth:`arrive`
        waits for (the current stream waits, the host does not), and from a pinned buffer the contiguous rows go
        straight from it (one DMA, no work on the host): only the halo rows are gathered on the host, into pinned
        staging. Elsewhere the rows are gathered as they are (no event)."""
        n = end - start
        shape = (n + halo.numel(), *buf.shape[1:])
        if self.device.type != "cuda":
            out = torch.empty(shape, dtype=buf.dtype, device=self.device)
            out[:n].copy_(buf[start:end])
            torch.index_select(buf, 0, halo, out=out[n:])
            return out, None
        direct = buf.is_pinned()
        staging = self.staging((halo.numel() if direct else shape[0], *shape[1:]), buf.dtype)
        if not direct:
            staging[:n].copy_(buf[start:end])
        torch.index_select(buf, 0, halo, out=staging if direct else staging[n:])
        with torch.cuda.stream(self._stream()):  # (after this stream's writes into ``buf``: :meth:`send_into`)
            out = torch.empty(shape, dtype=buf.dtype, device=self.device)
            if direct:
                out[:n].copy_(buf[start:end], non_blocking=True)
                out[n:].copy_(staging, non_blocking=True)
            else:
                out.copy_(staging, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._side)
        return out, done

    def send_into(self, dst: Tensor, rows: Tensor) -> Optional[tuple]:
        """Starts copying device ``rows`` straight into ``dst`` (a slice of a pinned tier buffer) on the side stream,
        after what the current stream has queued (which computes them): one DMA, no staging, no work on the host.
        ``None`` (nothing started: copy them now) unless on a GPU, not capturing, into pinned memory.
        :meth:`received` waits for the copy; reads by :meth:`fetch` run after it on the same stream."""
        if not self._dma(rows) or not dst.is_pinned():
            return None
        side = self._stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            dst.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        rows.record_stream(side)  # (its memory is not reused before the copy has read it)
        return dst, done

    def send(self, rows: Tensor) -> Optional[tuple]:
        """Starts copying device ``rows`` to pinned host memory on the side stream, after what the current stream
        has queued (which computes them); ``None`` (nothing started: copy them now) unless on a GPU and not
        capturing. :meth:`received` waits for the copy."""
        if not self._dma(rows):
            return None
        side = self._stream()
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        rows.record_stream(side)  # (its memory is not reused before the copy has read it)
        return host, done

    @staticmethod
    def received(sent: tuple) -> Tensor:
        """The host rows :meth:`send` copied, once the copy is done."""
        host, done = sent
        done.synchronize()
        return host

    def _dma(self, rows: Tensor) -> bool:
        return self.device.type == "cuda" and rows.device.type == "cuda" and \
            not torch.cuda.is_current_stream_capturing()

    def _stream(self):
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def arrive(self, fetched: tuple) -> Tensor:
        """The rows :meth:`fetch` started copying, usable on the current stream."""
        out, done = fetched
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            out.record_stream(current)  # (allocated on the side stream, used on this one)
        return self.to_device(out)

    def close(self) -> None:
        """Drops the files (the buffers must not be used after)."""
        self._maps = {}
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __del__(self):
        self.close()

    # ------------------------------------------------------------------ helpers
    def _budget(self) -> float:
        if self.offload is None:
            return float("inf")
        if self.budget == "auto":  # decided once, when the first buffer is made
            self.budget = free_memory(self.device) // 2
        return self.budget or 0

    def _mapped(self, shape, dtype: torch.dtype, nbytes: int) -> Tensor:
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="pyg_pipe_history_", dir=self.directory)
        path = os.path.join(self._tmp, f"buffer{self._count}.bin")
        self._count += 1
        with open(path, "wb+") as f:
            f.truncate(max(nbytes, 1))
            m = mmap.mmap(f.fileno(), max(nbytes, 1))
        os.unlink(path)  # the mapping keeps the file alive; nothing is left behind
        t = torch.frombuffer(m, dtype=dtype, count=_numel(shape)).view(shape)
        self._maps[t.untyped_storage().data_ptr()] = m
        return t


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` (available memory of the machine for a CPU). On a GPU: what this process can
    still allocate, the allocator's unused reserve included, within ``torch.cuda.set_per_process_memory_fraction``
    when one is set (the driver's free memory ignores it)."""
    if device.type == "cuda":
        if device.index is None:  # (get_per_process_memory_fraction wants an index)
            device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        free += torch.cuda.memory_reserved(device) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            free = min(free, max(0, int(fraction(device) * total) - allocated))
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
