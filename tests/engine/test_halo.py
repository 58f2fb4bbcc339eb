"""Halo rows at a call site (:mod:`pyg_pipe.engine.runtime.halo`): a chunk's ``[rows | halo]`` holds the true rows of
its halo vertices, and the gradients of those rows reach their owners.

* 2 ways, one chunk each (real gloo processes): the halo comes from the other way, equal to the whole-graph
  rows whatever the chunk's tensor held there (also with the vertices along dimension 1); the backward sends
  every halo row's gradient to its owner, so the ways' gradients add up to the whole graph's; the bytes are
  counted as ``halo_forward`` / ``halo_backward``.
* 4 chunks on one way (one process): the halo comes from history: rows of chunks that ran earlier in the pass
  are this pass's, the others the stored (stale) ones; in the drain (reverse order) a fresh read's gradient
  reaches its owner scaled by 2 (T3) and a stale read's is dropped.
"""
import torch

from pyg_pipe.engine import Comm
from pyg_pipe.engine.plan.grid import RankGrid
from pyg_pipe.engine.runtime.halo import HaloExchange
from pyg_pipe.engine.runtime.history import CallHistory
from pyg_pipe.engine.plan.schedule import Schedule
from pyg_pipe.graph import ChunkedGraph
from tests.dist import run_distributed

N, D = 40, 3
KEY = "conv#0.0:x"
CPU = torch.device("cpu")


def graph(ptr, ways):
    """A random graph (a few self loops) in shuffled vertex order, cut at ``ptr``."""
    g = torch.Generator().manual_seed(0)
    src, dst = torch.randint(0, N, (120,), generator=g), torch.randint(0, N, (120,), generator=g)
    loops = torch.arange(0, N, 9)
    src, dst = torch.cat([src, loops]), torch.cat([dst, loops])
    perm = torch.randperm(N, generator=g)
    return ChunkedGraph(src, dst, N, perm, torch.tensor(ptr), ways)


def rows_of(seed):
    """A whole-graph vertex tensor in new (chunk) ids."""
    return torch.randn(N, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def with_junk_halo(rows, halo):
    """What a layer holds for a chunk before the join: its rows, then anything (NaN) at the halo."""
    return torch.cat([rows, torch.full((halo, *rows.shape[1:]), float("nan"), dtype=rows.dtype)])


def _two_ways(rank, world):
    cg = graph([0, 17, N], ways=2)
    lg = cg.chunks[rank]
    other = 1 - rank
    assert lg.halo.numel() > 0 and bool((lg.halo_chunk == other).all())
    comm = Comm(CPU, timeout=60)
    exchange = HaloExchange(RankGrid(rank, world, 1, 2), comm, Schedule(2, 2))
    clock = torch.zeros(2, dtype=torch.long)
    X, M = rows_of(1), rows_of(2)

    # forward: the true halo rows, counted as halo_forward (this way's rows the other way reads)
    run = exchange.begin(CallHistory(N, CPU), clock, read_history=False, write_history=False)
    comm.counting = True
    with torch.no_grad():
        out = run.join(KEY, cg, lg, with_junk_halo(X[lg.start:lg.end], lg.halo.numel()), 0)
    comm.counting = False
    torch.testing.assert_close(out, X[lg.nodes], rtol=0, atol=0, msg=f"way {rank}: [rows | halo]")
    mirrors = cg.mirrors()[(rank, other)]
    assert comm.bytes["halo_forward"] == mirrors.numel() * D * 8, dict(comm.bytes)
    assert mirrors.numel() == int((cg.chunks[other].halo_chunk == rank).sum())

    # vertices along dimension 1 (heads first)
    stacked = torch.stack([X[lg.start:lg.end], -X[lg.start:lg.end]])
    junk = torch.full((2, lg.halo.numel(), D), float("nan"), dtype=torch.float64)
    with torch.no_grad():
        out = run.join(KEY, cg, lg, torch.cat([stacked, junk], 1), 1)
    torch.testing.assert_close(out, torch.stack([X[lg.nodes], -X[lg.nodes]]), rtol=0, atol=0, msg="vdim=1")

    # backward: each way's gradient lands on its own rows; summed over ways it is the whole graph's
    leaf = X.clone().requires_grad_()
    run = exchange.begin(CallHistory(N, CPU), clock, read_history=False, write_history=False)
    run.prepare([cg])
    joined = run.join(KEY, cg, lg, with_junk_halo(leaf[lg.start:lg.end], lg.halo.numel()), 0)
    comm.reset_counters()
    comm.counting = True
    (torch.sin(joined) * M[lg.nodes]).sum().backward()
    comm.counting = False
    assert comm.bytes["halo_backward"] == lg.halo.numel() * D * 8, dict(comm.bytes)
    ref = X.clone().requires_grad_()
    sum((torch.sin(ref[c.nodes]) * M[c.nodes]).sum() for c in cg.chunks).backward()
    mine = torch.zeros(N, dtype=torch.bool)
    mine[lg.start:lg.end] = True
    torch.testing.assert_close(leaf.grad[mine], ref.grad[mine], rtol=1e-12, atol=1e-12, msg=f"way {rank}: own rows")
    assert bool((leaf.grad[~mine] == 0).all()), "a gradient landed on rows another way owns"
    torch.testing.assert_close(comm.all_reduce(leaf.grad.clone()), ref.grad, rtol=1e-12, atol=1e-12)
    # the halo gradients matter: without them the own rows' gradient would be another one
    alone = X.clone().requires_grad_()
    (torch.sin(alone[lg.start:lg.end]) * M[lg.start:lg.end]).sum().backward()
    assert not torch.allclose(alone.grad[mine], ref.grad[mine])


def test_two_ways_join_the_true_halo_rows_and_send_their_gradients_to_the_owners():
    run_distributed(_two_ways, 2, timeout=120)


def test_several_chunks_per_way_read_their_halo_from_history_fresh_when_written_earlier_in_the_pass():
    cg = graph([0, 9, 20, 31, N], ways=1)
    schedule = Schedule(4, 1, shuffle=True, seed=0)
    step = 1
    order, clock = schedule.order(step, 0), schedule.clocks(step)
    assert sorted(order) == [0, 1, 2, 3] and [int(clock[c]) for c in order] == [0, 1, 2, 3]
    history = CallHistory(N, CPU)
    stale, X, M = rows_of(3), rows_of(4), rows_of(5)
    history.write(KEY, 0, stale)                   # what an earlier step left
    exchange = HaloExchange(RankGrid(0, 1, 1, 1), Comm(CPU), schedule)
    run = exchange.begin(history, clock, read_history=True, write_history=True)
    rows = {c: X[lg.start:lg.end].clone().requires_grad_() for c, lg in enumerate(cg.chunks)}
    outs, ran, reads = {}, set(), {"fresh": 0, "stale": 0}
    for c in order:
        lg = cg.chunks[c]
        outs[c] = run.join(KEY, cg, lg, with_junk_halo(rows[c], lg.halo.numel()), 0)
        fresh = torch.tensor([int(o) in ran for o in lg.halo_chunk], dtype=torch.bool)
        want = torch.where(fresh.view(-1, 1), X[lg.halo], stale[lg.halo])
        torch.testing.assert_close(outs[c][:lg.rows], X[lg.start:lg.end], rtol=0, atol=0, msg=f"chunk {c}: rows")
        torch.testing.assert_close(outs[c][lg.rows:], want, rtol=0, atol=0, msg=f"chunk {c}: halo")
        reads["fresh"] += int(fresh.sum())
        reads["stale"] += int((~fresh).sum())
        ran.add(c)
    assert reads["fresh"] > 0 and reads["stale"] > 0, reads
    torch.testing.assert_close(history.buffers[KEY], X, rtol=0, atol=0, msg="history holds this pass's rows")

    # the drain: chunks in reverse order, each reading its gradient from the later chunks' fresh reads
    run.prepare([cg])
    for c in reversed(order):
        (outs[c] * M[cg.chunks[c].nodes]).sum().backward()
    want = M.clone()
    for reader in cg.chunks:
        for v, o in zip(reader.halo.tolist(), reader.halo_chunk.tolist()):
            if clock[o] < clock[reader.index]:     # fresh: the owner ran earlier; T3 scales it by 2
                want[v] += 2 * M[v]
    for c, lg in enumerate(cg.chunks):
        torch.testing.assert_close(rows[c].grad, want[lg.start:lg.end], rtol=1e-12, atol=1e-12, msg=f"chunk {c}")
    assert not torch.equal(want, M)
