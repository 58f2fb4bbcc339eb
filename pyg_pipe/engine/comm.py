"""The engine's transport: every message between ranks, with the bytes counted and failures propagated.

Tensors between stages and ways go through ``torch.distributed`` ``isend``/``irecv``, grouped with
``batch_isend_irecv`` where two ranks send to each other (NCCL on GPUs, gloo on CPU); collectives
(all-reduce, all-gather, broadcast, small Python objects) are posted asynchronously and waited on
like them. Bytes sent while :attr:`Comm.counting` is on are added to a category:

==================== ===============================================================
``stage_activations`` forward rows of the value that feeds the next stage's first layer
``stage_gradients``   their gradients, sent backwards
``carried``           any other tensor crossing a cut (GCNII's ``x0``), both directions
``halo_forward``      rows of boundary vertices sent to the graph-parallel ways that read them
                      (at every propagate call whose source rows are computed by the model)
``halo_backward``     the gradients of those rows, sent back to their owners
``weight_allreduce``  weight gradients all-reduced among the ways of a stage (counted as a ring
                      all-reduce: ``2·(W-1)/W`` of the gradient per rank)
``output``            the last stage's output rows, sent to every other rank
``other``             anything else
==================== ===============================================================

With :attr:`Comm.boundary_dtype` set (the engine sets ``boundary_dtype`` around training passes only;
the exact pass and inference stay in the values' own dtype), floating-point tensors of the categories
in :data:`BOUNDARY` travel in that narrower dtype and are cast back on arrival: bf16 halves those bytes.

A **simulated link** for benchmarks on one machine, where loopback moves bytes far faster relative to
compute than PCIe or a network does between GPUs: ``PYG_PIPE_SIMULATED_BANDWIDTH=<bytes/s>`` makes
every point-to-point receive and halo exchange complete no earlier than ``bytes / bandwidth`` after it
was posted (:meth:`Comm.simulate_link`), so a receive posted ahead overlaps the delay with compute.
Collectives (the weight all-reduce) are not delayed.

**Staging through host memory** (``staging="host"``; ``"auto"``, the default, stages when the device is a
GPU and the process group's backend is gloo): tensors on the device are copied to host memory before they
are sent or reduced and received into host memory, then copied to the device. Gloo moves only host
tensors point to point, so this is what lets several processes share one GPU (NCCL refuses two ranks on
one device) and run the whole pipeline there: fill, drain, links, halos and history on CUDA, the bytes
through the host. Every copy to the host waits for the device (it is a transport for one machine, not a
fast one); with NCCL nothing is staged.

No wait can hang: a rank that fails posts its error in the process group's store
(:meth:`Comm.post_error`) and exits, which closes its connections; a peer blocked on it then fails,
finds the posted error and raises :class:`RemoteRankError` carrying the original message. A wait
longer than ``timeout`` seconds fails naming what it waited for. The store is read only when a wait
or a post fails (a round trip to it per message would cost more than the message).
"""
from __future__ import annotations

import os
import pickle
import time
from collections import defaultdict
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

CATEGORIES = ("stage_activations", "stage_gradients", "carried", "halo_forward", "halo_backward",
              "weight_allreduce", "output", "other")
#: what crosses a stage cut or a halo: sent in :attr:`Comm.boundary_dtype` when one is set
BOUNDARY = frozenset(("stage_activations", "stage_gradients", "carried", "halo_forward", "halo_backward"))
_ERROR_KEY = "pyg_pipe/error"


class RemoteRankError(RuntimeError):
    """Another rank failed; the message carries its original error."""


class CommFailure(RuntimeError):
    """A transfer or collective could not complete and no rank posted why: a peer stopped, is stuck, or is slower
    than ``comm_timeout`` (a peer that failed and posted its error gives :class:`RemoteRankError` instead). Not an
    error of the model's code: a pass that meets it says so as it is (:func:`~.step.checks.run_checked`)."""


class PendingRecv:
    """A posted receive (:meth:`Comm.irecv`): :meth:`get` waits for it and returns the tensor."""

    __slots__ = ("comm", "work", "buf", "what", "dtype", "posted")

    def __init__(self, comm: "Comm", work, buf: Tensor, what: str, dtype: torch.dtype):
        self.comm, self.work, self.buf, self.what, self.dtype = comm, work, buf, what, dtype
        self.posted = time.perf_counter() if comm.simulated_bandwidth else 0.0

    def get(self) -> Tensor:
        self.comm.wait(self.work, self.what)
        self.comm.simulate_link(self.posted, self.buf.numel() * self.buf.element_size())
        buf = self.comm._arrived(self.buf)
        return buf if buf.dtype == self.dtype else buf.to(self.dtype)


class Comm:
    """Counted, failure-aware point-to-point messaging for one rank.

    Args:
        device: where received tensors are allocated.
        timeout: seconds one wait may take before :class:`TimeoutError`.
        group: process group (default: world).
        staging: ``"host"`` stages device tensors through host memory (module docstring), ``None`` never,
            ``"auto"`` when the device is a GPU and the backend gloo.
    """

    def __init__(self, device: torch.device, timeout: float = 600.0, group=None, staging: Optional[str] = "auto"):
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if initialized else 0
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.device = device
        if staging not in ("auto", "host", None):
            raise ValueError(f"staging={staging!r}: use 'auto', 'host' or None.")
        if staging == "auto":
            staging = "host" if initialized and device.type == "cuda" and dist.get_backend(group) == "gloo" else None
        self.staging = staging
        #: where tensors travel: host memory when staging, else the device
        self.wire_device = torch.device("cpu") if staging == "host" else device
        self.timeout = timeout
        self.group = group
        self.counting = False
        self.boundary_dtype: Optional[torch.dtype] = None   # set by the engine around training passes only
        self.simulated_bandwidth = float(os.environ.get("PYG_PIPE_SIMULATED_BANDWIDTH", 0) or 0)  # bytes/s
        self.waited = 0.0                                   # host seconds blocked in waits (:mod:`.runtime.timeline`)
        self.bytes: Dict[str, int] = defaultdict(int)
        self._pending: List[Tuple[object, Tensor]] = []
        self._remote_error: Optional[str] = None
        try:
            self._store = dist.distributed_c10d._get_default_store() if initialized else None
        except Exception:  # noqa: BLE001 - no store: waits still time out
            self._store = None

    # -- sending -----------------------------------------------------------------------------
    def send(self, tensor: Tensor, dst: int, category: Optional[str] = "other") -> None:
        """Posts an asynchronous send; the tensor is kept alive until :meth:`flush`.
        ``category=None`` sends uncounted (plan-time headers)."""
        tensor = self._staged(self._to_wire(tensor.detach(), category in BOUNDARY).contiguous())
        if self.counting and category is not None:
            self.bytes[category] += tensor.numel() * tensor.element_size()
        work = self._post(f"a send to rank {dst}", dist.isend, tensor, dst, group=self.group)
        self._pending.append((work, tensor))

    def all_reduce_gradients(self, tensor: Tensor, group, group_size: int, first: bool) -> None:
        """Sums ``tensor`` in place over ``group`` and counts it as a ring all-reduce under
        ``weight_allreduce``: ``2·(W-1)·n·b`` bytes for the group, split evenly over its ranks
        (``first`` takes the remainder, so the group's total is exact)."""
        if group_size > 1:
            self.all_reduce(tensor, group, "the weight-gradient all-reduce")
            if self.counting:
                total = 2 * (group_size - 1) * tensor.numel() * tensor.element_size()
                share = total // group_size
                self.bytes["weight_allreduce"] += share + (total - share * group_size if first else 0)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, boundary: bool = False) -> Tensor:
        """Receives one tensor of known shape and dtype from ``src`` (``boundary``: sent under a
        :data:`BOUNDARY` category, so in :attr:`boundary_dtype` if one is set)."""
        return self.irecv(shape, dtype, src, boundary).get()

    def irecv(self, shape: Sequence[int], dtype: torch.dtype, src: int, boundary: bool = False) -> "PendingRecv":
        """Posts the receive of one tensor of known shape and dtype from ``src`` and returns at once, so the
        transfer can proceed while this rank computes (NCCL moves a p2p message only once both sides have
        posted it); :meth:`PendingRecv.get` waits for it. Messages from one rank match the receives in
        the order they were posted."""
        buf = torch.empty(tuple(shape), dtype=self._wire(dtype, boundary), device=self.wire_device)
        what = f"receive from rank {src}"
        return PendingRecv(self, self._post(what, dist.irecv, buf, src, group=self.group), buf, what, dtype)

    def _wire(self, dtype: torch.dtype, boundary: bool) -> torch.dtype:
        """The dtype a tensor of ``dtype`` travels in: :attr:`boundary_dtype` for floating-point values
        wider than it crossing a stage cut or a halo (``boundary``), else its own. Sender and receiver
        apply the same rule, so the receiver allocates the wire dtype and casts back to ``dtype``."""
        b = self.boundary_dtype
        if b is None or not boundary or not dtype.is_floating_point or torch.finfo(dtype).bits <= torch.finfo(b).bits:
            return dtype
        return b

    def _to_wire(self, tensor: Tensor, boundary: bool) -> Tensor:
        wire = self._wire(tensor.dtype, boundary)
        return tensor if wire == tensor.dtype else tensor.to(wire)

    def _staged(self, tensor: Tensor) -> Tensor:
        """``tensor`` where it travels: a host copy when staging (the copy waits for the device)."""
        return tensor.to(self.wire_device) if self.staging and tensor.device != self.wire_device else tensor

    def _arrived(self, buf: Tensor) -> Tensor:
        """A received buffer on the device."""
        return buf.to(self.device) if self.staging and buf.device != self.device else buf

    def exchange(self, sends: Sequence[Tuple[Tensor, int]], recvs: Sequence[Tuple[Sequence[int], torch.dtype, int]],
                 category: str = "other") -> List[Tensor]:
        """Posts every send and receive of one exchange together (``batch_isend_irecv``, so NCCL
        never deadlocks on two ranks sending to each other) and waits for all of them.

        ``sends``: ``(tensor, dst)``; ``recvs``: ``(shape, dtype, src)``. Returns the received tensors.
        """
        ops, keep, boundary = [], [], category in BOUNDARY
        for tensor, dst in sends:
            tensor = self._staged(self._to_wire(tensor.detach(), boundary).contiguous())
            if self.counting:
                self.bytes[category] += tensor.numel() * tensor.element_size()
            keep.append(tensor)
            ops.append(dist.P2POp(dist.isend, tensor, dst, group=self.group))
        out = []
        for shape, dtype, src in recvs:
            buf = torch.empty(tuple(shape), dtype=self._wire(dtype, boundary), device=self.wire_device)
            out.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, src, group=self.group))
        if ops:
            posted = time.perf_counter() if self.simulated_bandwidth else 0.0
            for work in self._post("a halo exchange", dist.batch_isend_irecv, ops):
                self.wait(work, "halo exchange")
            self.simulate_link(posted, sum(b.numel() * b.element_size() for b in out))
        out = [self._arrived(buf) for buf in out]
        return [buf if buf.dtype == dtype else buf.to(dtype) for buf, (_, dtype, _) in zip(out, recvs)]

    def send_object(self, obj, dst: int) -> None:
        """Sends a small picklable object (uncounted; plan time only: the receiver reads it on the host)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        self.send(torch.tensor([data.numel()], dtype=torch.long, device=self.device), dst, None)
        self.send(data, dst, None)

    def recv_object(self, src: int):
        n = int(self.recv([1], torch.long, src))
        return pickle.loads(self.recv([n], torch.uint8, src).cpu().numpy().tobytes())

    def flush(self) -> None:
        """Waits for every posted send."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self.wait(work, "send")

    def simulate_link(self, posted: float, nbytes: int) -> None:
        """Benchmarks only (``PYG_PIPE_SIMULATED_BANDWIDTH`` bytes/s, unset: off): a receive posted at
        ``posted`` completes no earlier than ``nbytes / bandwidth`` after it, as if the bytes started to
        move when the receive was posted (as NCCL's p2p does) over a link of that bandwidth. A receive
        posted ahead (overlap) therefore hides the delay behind compute; one waited on at once pays it."""
        if self.simulated_bandwidth:
            left = posted + nbytes / self.simulated_bandwidth - time.perf_counter()
            if left > 0:
                time.sleep(left)
                self.waited += left

    # -- collectives (uncounted: planning, statistics, checkpoints) ------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def rank_in(self, group) -> int:
        """This rank's index in ``group`` (``None``: the world)."""
        return dist.get_rank(group) if self.distributed else 0

    def all_reduce(self, tensor: Tensor, group=None, what: str = "an all-reduce", op: str = "sum") -> Tensor:
        """Reduces ``tensor`` in place over ``group`` (``op``: ``"sum"``, ``"min"`` or ``"max"``)."""
        if self.distributed:
            reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
            wire = self._staged(tensor)
            self.wait(self._post(what, dist.all_reduce, wire, op=reduce_op, group=group, async_op=True), what)
            if wire is not tensor:
                with torch.no_grad():
                    tensor.copy_(wire)
        return tensor

    def all_gather(self, tensor: Tensor, group=None, what: str = "an all-gather") -> List[Tensor]:
        """Every rank's ``tensor`` (all of the same shape), in rank order of ``group``."""
        if not self.distributed:
            return [tensor]
        wire = self._staged(tensor)
        parts = [torch.empty_like(wire) for _ in range(dist.get_world_size(group))]
        self.wait(self._post(what, dist.all_gather, parts, wire, group=group, async_op=True), what)
        return [self._arrived(p) for p in parts]

    def broadcast(self, tensor: Tensor, src: int, what: str = "a broadcast", group=None) -> Tensor:
        """``src``'s ``tensor`` on every rank (on the device the tensor came from)."""
        if not self.distributed:
            return tensor
        buf = self._staged(tensor.to(self.device).contiguous())
        self.wait(self._post(what, dist.broadcast, buf, src, group=group, async_op=True), what)
        return buf.to(tensor.device)

    def all_gather_objects(self, obj, what: str = "sharing a small object", group=None) -> list:
        """Every rank's picklable ``obj``, in rank order (small objects: decisions, refusals)."""
        if not self.distributed:
            return [obj]
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        sizes = self.all_gather(torch.tensor([data.numel()], dtype=torch.long, device=self.device), group, what)
        longest = int(max(int(n) for n in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        padded[:data.numel()] = data
        parts = self.all_gather(padded, group, what)
        return [pickle.loads(p[:int(n)].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]

    def barrier(self, what: str = "a barrier", group=None) -> None:
        """Returns when every rank of ``group`` got here."""
        self.all_reduce(torch.zeros(1, device=self.device), group, what)

    # -- waiting and failures ------------------------------------------------------------------
    def _post(self, what: str, fn, *args, **kwargs):
        """Posts an operation; if the transport refuses it (a peer's connection is gone), the peer's posted
        error is raised instead of the transport's."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - translated below
            self.check_remote_error()
            raise CommFailure(f"pyg_pipe rank {self.rank}: {what} could not be posted ({exc}). Another rank "
                               f"stopped.") from exc

    def wait(self, work, what: str) -> None:
        """Blocks on ``work``; a failure of the peer surfaces as :class:`RemoteRankError` with its cause.

        A peer that fails posts its error and exits, closing its connections, which ends the wait with
        an error; this rank then raises the peer's original error instead of a connection error.
        """
        t0 = time.perf_counter()
        try:
            work.wait(timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - translated below
            self.check_remote_error()
            raise CommFailure(
                f"pyg_pipe rank {self.rank}: {what} failed ({exc}). Another rank is stuck or died; if stages are "
                f"just slow, raise `comm_timeout` (now {self.timeout:.0f} s).") from exc
        finally:
            self.waited += time.perf_counter() - t0

    def check_remote_error(self) -> None:
        msg = self._remote_error
        if msg is None and self._store is not None:
            try:
                if self._store.check([_ERROR_KEY]):
                    msg = self._store.get(_ERROR_KEY).decode(errors="replace")
            except Exception:  # noqa: BLE001 - store gone: the process group is going down anyway
                msg = None
        if msg is not None and not msg.startswith(f"rank {self.rank} "):
            raise RemoteRankError(msg)

    def post_error(self, exc: BaseException) -> None:
        """Tells every other rank that this one failed, and why."""
        if self._store is None or isinstance(exc, RemoteRankError):
            return
        try:
            if not self._store.check([_ERROR_KEY]):
                self._store.set(_ERROR_KEY, f"rank {self.rank} failed with {type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - the store itself may be gone
            pass

    # -- accounting ------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        self.bytes = defaultdict(int)

    def totals(self, reduce: bool = True) -> Dict[str, int]:
        """Bytes per category (and ``total``), summed over all ranks when ``reduce``."""
        vals = torch.tensor([self.bytes.get(c, 0) for c in CATEGORIES], dtype=torch.float64)
        if reduce and self.world_size > 1:
            vals = self.all_reduce(vals.to(self.device), self.group, "summing the byte counters")
        out = {c: int(v) for c, v in zip(CATEGORIES, vals.tolist())}
        out["total"] = sum(out[c] for c in CATEGORIES)
        return out
