"""The transport (:class:`pyg_pipe.engine.comm.Comm`): what one rank sends another arrives intact, every byte
is counted in its category while counting is on (and none while it is off), the collectives combine every
rank's value, and no wait can hang: a peer that fails and posts its error makes a rank blocked on it raise
:class:`RemoteRankError` with the peer's own message, and a peer that never sends makes the wait fail after
``timeout`` naming what it waited for and ``comm_timeout``.

Everything runs on real gloo processes, in one launch of 3 ranks (the failures last: they break the process
group); a second launch posts to a peer that already failed.
"""
import pickle

import pytest
import torch
import torch.distributed as dist

from pyg_pipe.engine import CATEGORIES, Comm, CommFailure, RemoteRankError
from tests.dist import run_distributed

CPU = torch.device("cpu")


def _point_to_point(comm, rank, world):
    """send / recv, exchange and send_object, with the byte counters (a ring: rank r sends to r+1)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    t = torch.arange(6, dtype=torch.float64).view(2, 3) + 10 * rank

    # counting off: delivered, nothing counted
    comm.send(t, nxt, "carried")
    got = comm.recv((2, 3), torch.float64, prv)
    comm.flush()
    torch.testing.assert_close(got, torch.arange(6, dtype=torch.float64).view(2, 3) + 10 * prv, rtol=0, atol=0)
    assert sum(comm.bytes.values()) == 0, f"bytes counted while counting was off: {dict(comm.bytes)}"

    # counting on: the tensor's bytes under its category; category None (headers) uncounted
    comm.counting = True
    comm.send(t, nxt, "carried")
    comm.send(torch.ones(5, dtype=torch.int32), nxt, None)
    comm.send(torch.ones(7, dtype=torch.uint8), nxt)  # default category: other
    comm.recv((2, 3), torch.float64, prv)
    comm.recv((5,), torch.int32, prv)
    comm.recv((7,), torch.uint8, prv)
    comm.flush()
    assert comm.bytes["carried"] == 48 and comm.bytes["other"] == 7, dict(comm.bytes)
    assert sum(comm.bytes.values()) == 55, f"an uncounted send was counted: {dict(comm.bytes)}"

    # exchange: every rank sends to every other at once (sizes differ per pair) and gets what each sent
    sends = [(torch.full((rank + 1, 2), float(100 * rank + w)), w) for w in range(world) if w != rank]
    recvs = [((w + 1, 2), torch.float32, w) for w in range(world) if w != rank]
    got = comm.exchange(sends, recvs, "halo_forward")
    for (_, _, w), g in zip(recvs, got):
        torch.testing.assert_close(g, torch.full((w + 1, 2), float(100 * w + rank)), rtol=0, atol=0,
                                   msg=f"rank {rank}: exchange from rank {w}")
    assert comm.bytes["halo_forward"] == (world - 1) * (rank + 1) * 2 * 4, dict(comm.bytes)
    assert comm.exchange([], [], "halo_backward") == [] and comm.bytes["halo_backward"] == 0

    # small objects, of any size, uncounted (plan-time headers)
    before = dict(comm.bytes)
    obj = {"rank": rank, "spec": ("tuple", (("leaf", 0), ("value", None))), "pad": "x" * (1000 * rank)}
    comm.send_object(obj, nxt)
    back = comm.recv_object(prv)
    comm.flush()
    assert back == {"rank": prv, "spec": ("tuple", (("leaf", 0), ("value", None))), "pad": "x" * (1000 * prv)}
    assert dict(comm.bytes) == before, "send_object was counted"

    # counting off again: nothing more counted
    comm.counting = False
    comm.exchange(sends, recvs, "halo_forward")
    assert dict(comm.bytes) == before


def _gradient_all_reduce(comm, rank, world, pair):
    """all_reduce_gradients sums in place and counts a ring all-reduce, 2·(W-1)·n·b split over the group."""
    comm.reset_counters()
    assert sum(comm.bytes.values()) == 0
    comm.counting = True
    g = torch.full((5,), float(rank + 1))                            # float32, 20 bytes
    comm.all_reduce_gradients(g, None, world, first=rank == 0)       # 2·2·20 = 80 over 3 ranks: 26, 26, 26 + 2
    torch.testing.assert_close(g, torch.full((5,), float(sum(range(1, world + 1)))), rtol=0, atol=0)
    share = 80 // 3 + (80 % 3 if rank == 0 else 0)
    assert comm.bytes["weight_allreduce"] == share, dict(comm.bytes)
    whole = comm.totals(reduce=True)
    assert whole["weight_allreduce"] == 80, f"the group's total must be exact: {whole}"

    if rank in (1, 2):                                              # a group of 2: 2·1·4·8 = 64, 32 each
        h = torch.full((4,), float(rank), dtype=torch.float64)
        comm.all_reduce_gradients(h, pair, 2, first=comm.rank_in(pair) == 0)
        torch.testing.assert_close(h, torch.full((4,), 3.0, dtype=torch.float64), rtol=0, atol=0)
        share += 32
        assert comm.bytes["weight_allreduce"] == share, dict(comm.bytes)
    one = torch.ones(3)
    comm.all_reduce_gradients(one, None, 1, first=True)              # a group of one: nothing to do, nothing counted
    torch.testing.assert_close(one, torch.ones(3))
    comm.counting = False
    comm.all_reduce_gradients(torch.ones(3), None, world, first=rank == 0)  # counting off
    assert comm.bytes["weight_allreduce"] == share, dict(comm.bytes)


def _collectives(comm, rank, world, pair):
    t = torch.tensor([rank, -rank, 2 * rank + 1], dtype=torch.float64)
    for op, want in [("sum", [3, -3, 9]), ("min", [0, -2, 1]), ("max", [2, 0, 5])]:
        out = comm.all_reduce(t.clone(), op=op)
        torch.testing.assert_close(out, torch.tensor(want, dtype=torch.float64), rtol=0, atol=0, msg=op)
    if rank in (1, 2):
        out = comm.all_reduce(torch.tensor([float(rank)]), pair)
        assert out.item() == 3.0, "all_reduce over a subgroup"

    parts = comm.all_gather(torch.full((2, 2), rank, dtype=torch.long))
    assert [p.tolist() for p in parts] == [[[r, r], [r, r]] for r in range(world)]

    b = comm.broadcast(torch.full((3,), float(rank)), 1)
    assert b.tolist() == [1.0, 1.0, 1.0], f"rank {rank}: broadcast from rank 1 gave {b.tolist()}"

    objs = comm.all_gather_objects({"rank": rank, "blob": list(range(50 * rank))})
    assert objs == [{"rank": r, "blob": list(range(50 * r))} for r in range(world)]
    assert len({len(pickle.dumps(o)) for o in objs}) == world  # the objects really differ in size

    assert comm.rank_in(None) == rank
    if rank in (1, 2):
        assert comm.rank_in(pair) == rank - 1

    # barrier: nobody leaves before every rank arrived (each marks its arrival in the store first, with add, which
    # waits for the store's answer: a set is sent without one, so it may land after the barrier on a loaded machine)
    store = dist.distributed_c10d._get_default_store()
    store.add(f"test/arrived/{rank}", 1)
    comm.barrier()
    assert store.check([f"test/arrived/{r}" for r in range(world)]), "left the barrier before every rank got there"
    comm.barrier()  # (again: the store keys above were read before anyone goes on)


def _byte_totals(comm, rank, world):
    """totals(reduce=False) is this rank's counters, totals(reduce=True) their sum over the ranks."""
    def counters(r):
        return {"carried": 48 * (r + 1), "other": 7, "halo_forward": 1000 + r}
    comm.reset_counters()
    assert sum(comm.bytes.values()) == 0
    comm.bytes.update(counters(rank))
    mine = comm.totals(reduce=False)
    assert mine == {**{c: counters(rank).get(c, 0) for c in CATEGORIES}, "total": sum(counters(rank).values())}, mine
    whole = comm.totals(reduce=True)
    want = {c: sum(counters(r).get(c, 0) for r in range(world)) for c in CATEGORIES}
    assert whole == {**want, "total": sum(want.values())}, whole


def _silent_peer(rank, pair01):
    """A peer that never sends: the wait fails after ``timeout`` naming the wait and comm_timeout. (Gloo closes
    every connection of a group after a timeout: this runs on a group of its own, and rank 1 waits in the store.)"""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        slow = Comm(CPU, timeout=2, group=pair01)
        try:
            with pytest.raises(RuntimeError) as info:
                slow.recv((3,), torch.float32, 1)
        finally:
            store.set("test/timed_out", "1")
        assert type(info.value) is CommFailure, f"a timeout is not a remote error: {info.value!r}"
        msg = str(info.value)
        assert "receive from rank 1" in msg and "comm_timeout" in msg and "now 2 s" in msg, msg
    elif rank == 1:
        store.wait(["test/timed_out"])  # alive, never sending


def _remote_failure(comm, rank, pair):
    """Rank 2 fails and posts its error; rank 0 (blocked in a receive from it) and rank 1 (blocked in a
    collective with it) raise RemoteRankError with rank 2's message."""
    watchful = Comm(CPU, timeout=10)
    store = dist.distributed_c10d._get_default_store()
    if rank == 2:
        store.wait(["test/done/0", "test/done/1"])  # (a wait that succeeded still reports a posted error)
        try:
            raise ValueError("boom: the layer on rank 2 failed")
        except ValueError as exc:
            watchful.post_error(exc)
            watchful.check_remote_error()  # its own posted error is not a remote one
        return  # exits: its connections close
    store.set(f"test/done/{rank}", "1")
    with pytest.raises(RemoteRankError) as info:
        if rank == 0:
            watchful.recv((4,), torch.float32, 2)
        else:
            watchful.all_reduce(torch.ones(4), pair, "a statistics all-reduce")
    msg = str(info.value)
    assert "rank 2 failed with ValueError: boom: the layer on rank 2 failed" in msg, msg
    # rank 0 hosts the store: it must outlive rank 1's reading of the posted error
    store.set(f"test/read/{rank}", "1")
    if rank == 0:
        store.wait(["test/read/1"])


def _worker(rank, world):
    comm = Comm(CPU, timeout=60)
    pair, pair01 = dist.new_group([1, 2]), dist.new_group([0, 1])
    assert (comm.rank, comm.world_size, comm.distributed) == (rank, world, True)
    assert comm.staging is None  # gloo on CPU: nothing to stage (CUDA tensors over gloo: tests/test_gpu.py)
    _point_to_point(comm, rank, world)
    _byte_totals(comm, rank, world)
    _gradient_all_reduce(comm, rank, world, pair)
    _collectives(comm, rank, world, pair)
    _silent_peer(rank, pair01)
    _remote_failure(comm, rank, pair)  # last: rank 2 leaves


def test_messages_arrive_bytes_are_counted_collectives_combine_and_no_wait_hangs():
    run_distributed(_worker, 3, timeout=120)


def _send_after_failure(rank, world):
    comm = Comm(CPU, timeout=10)
    if rank == 1:
        try:
            raise ValueError("boom on rank 1")
        except ValueError as exc:
            comm.post_error(exc)
        return
    with pytest.raises(RemoteRankError, match="rank 1 failed with ValueError: boom on rank 1"):
        comm.recv((3,), torch.float32, 1)   # blocked on rank 1 when it fails: the contract holds
    with pytest.raises(RemoteRankError, match="rank 1 failed with ValueError: boom on rank 1"):
        comm.send(torch.ones(3), 1)          # posted to a connection known to be closed
        comm.flush()


def test_a_send_to_a_rank_that_failed_raises_its_error():
    run_distributed(_send_after_failure, 2, timeout=60)


def test_a_single_process_comm_needs_no_process_group():
    """Without a process group every collective is the identity and nothing is counted."""
    comm = Comm(CPU)
    assert (comm.rank, comm.world_size, comm.distributed) == (0, 1, False)
    t = torch.tensor([1.0, 2.0])
    assert comm.all_reduce(t, op="max") is t and comm.all_gather(t) == [t] and comm.broadcast(t, 0) is t
    assert comm.all_gather_objects({"a": 1}) == [{"a": 1}] and comm.rank_in(None) == 0
    comm.barrier()
    comm.counting = True
    comm.all_reduce_gradients(t, None, 1, True)
    assert comm.totals() == {**{c: 0 for c in CATEGORIES}, "total": 0}


def test_the_simulated_link_holds_a_receive_for_bytes_over_bandwidth(monkeypatch):
    """Benchmarks' simulated link (``PYG_PIPE_SIMULATED_BANDWIDTH``): a receive completes no earlier than
    bytes / bandwidth after it was posted; unset, nothing is delayed (only a lower bound is checked)."""
    import time
    monkeypatch.setenv("PYG_PIPE_SIMULATED_BANDWIDTH", "1e6")
    comm = Comm(torch.device("cpu"))
    assert comm.simulated_bandwidth == 1e6
    t0 = time.perf_counter()
    comm.simulate_link(t0, 50_000)           # 50 kB at 1 MB/s: 50 ms after t0
    assert time.perf_counter() - t0 >= 0.05
    monkeypatch.delenv("PYG_PIPE_SIMULATED_BANDWIDTH")
    assert Comm(torch.device("cpu")).simulated_bandwidth == 0


def test_staging_is_checked():
    with pytest.raises(ValueError, match="staging='pinned'"):
        Comm(CPU, staging="pinned")
    assert Comm(CPU, staging="host").wire_device == CPU
