"""Where a gnnpipe process's resident peak goes step after step: glibc's bytes in use against the freed bytes it
keeps, after every step of a 2-stage pipeline (2 gloo processes, the engine driven directly, no Lightning).

The 16-layer GCNII of ``benchmarks/speed/gnnpipe_epoch.py`` on its 20,000-vertex community graph, 4 chunks, Adam,
one thread a process. After each step every rank records its resident high-water mark (net of what it held before
the engine was built) and glibc's ``mallinfo2``: bytes in use, freed bytes kept in the heap, bytes in ``mmap``-ed
blocks; and the step's time. A high-water mark that creeps while the bytes in use stay flat is the allocator's
fragmentation, not a leak (docs/memory.md). glibc only (Linux).

    python benchmarks/memory/allocator_creep.py --steps 24 --out creep.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks", "speed")]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_mb():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return m.uordblks / 2**20, m.fordblks / 2**20, m.hblkhd / 2**20


def _hwm_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _worker(rank, world, spec):
    import torch
    import torch.nn.functional as F

    import pyg_pipe.ops as ops
    from gnnpipe_epoch import build
    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    ops.install()
    args = SimpleNamespace(graph="community", nodes=spec["nodes"], classes=8, degree=20.0, features=64,
                           model="gcnii", hidden=64, layers=16)
    data, model = build(args)
    ops.fuse_messages(model)
    base = _hwm_mb()
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=spec["chunks"], grid="pipeline"), Comm(torch.device("cpu")),
                           num_stages=world, ways=1)
    engine.install()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rows = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        out = model(data.x, data.adj_t)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds = time.perf_counter() - t0
        rows.append([_hwm_mb() - base, *_malloc_mb(), seconds])
    engine.uninstall()
    with open(f"{spec['out']}.rank{rank}", "w") as f:
        json.dump(rows, f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--out", default="allocator_creep.json")
    args = p.parse_args()
    from tests.dist import run_distributed
    spec = {"steps": args.steps, "nodes": args.nodes, "chunks": args.chunks, "out": args.out}
    run_distributed(_worker, 2, spec, timeout=1800)
    result = {"setting": spec, "columns": ["hwm_net_mb", "in_use_mb", "free_kept_mb", "mmapped_mb", "step_s"],
              "ranks": []}
    for rank in range(2):
        with open(f"{args.out}.rank{rank}") as f:
            result["ranks"].append(json.load(f))
        os.remove(f"{args.out}.rank{rank}")
    for rank, rows in enumerate(result["ranks"]):
        first, last = rows[0], rows[-1]
        print(f"rank {rank}: high-water mark {first[0]:.0f} -> {last[0]:.0f} MB net after {len(rows)} steps; in use "
              f"{first[1]:.0f} -> {last[1]:.0f} MB, freed and kept {first[2]:.0f} -> {last[2]:.0f} MB; median step "
              f"{statistics.median(r[4] for r in rows[len(rows) // 4:]):.3f} s")
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
