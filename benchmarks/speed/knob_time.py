"""Step time with a boolean engine knob off and on, side by side in one run (alternating rounds of steps
of two engines on the same processes), so the machine's drift hits both alike.

    python benchmarks/speed/knob_time.py --knob recompute         # 16-layer GCNII, 20k vertices, 4 and 8 chunks
    python benchmarks/speed/knob_time.py --knob overlap --procs 4 --chunks 16
    python benchmarks/speed/knob_time.py --knob overlap --bandwidth 1e8   # a simulated 100 MB/s link
    python benchmarks/speed/knob_time.py --knob recompute --nodes 5000 --layers 8 --rounds 3

``--knob`` is a :class:`pyg_pipe.engine.PipelineConfig` field taking ``False`` / ``True`` (``recompute``,
``overlap``, ``shuffle_chunks``, ...); every other knob keeps its default but ``balance="layers"`` (the
same split in both engines) and ``--fixed`` ones (``--fixed recompute=0``). Prints, per chunk count, the
median step time of each (the last rank, whose stage finishes last) and their ratio per round.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _worker(rank, world, args):
    from torch_geometric.utils import to_torch_csr_tensor

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig, sync_module_state
    from pyg_pipe.graph import sbm_graph
    from pyg_pipe.models import gcnii

    N = args.nodes
    data = sbm_graph(N, num_classes=max(N // 125, 8), avg_degree=args.degree, homophily=0.9, num_features=64, seed=0)
    data.y = data.y % 8
    adj = to_torch_csr_tensor(data.edge_index.flip(0), size=(N, N))
    fixed = {k: bool(int(v)) for k, v in (f.split("=") for f in args.fixed)}
    for chunks in args.chunks:
        runs = {}
        for rc in (False, True):
            torch.manual_seed(0)
            model = gcnii(64, 64, 8, num_layers=args.layers, dropout=args.dropout, cached=True)
            sync_module_state(model, {}, [0])
            cfg = PipelineConfig(num_chunks=chunks, balance="layers", **fixed, **{args.knob: rc})
            engine = GNNPipeEngine(model, cfg, Comm(torch.device("cpu")), num_stages=world, ways=1)
            runs[rc] = (model, engine, torch.optim.Adam(model.parameters(), lr=0.01), [])

        def step(rc):
            model, engine, opt, times = runs[rc]
            engine.install()
            t0 = time.perf_counter()
            out = model(data.x, adj)
            loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            engine.uninstall()
        for _ in range(2):  # planning, history, warm-up
            step(False)
            step(True)
        for rc in (False, True):
            runs[rc][3].clear()
            runs[rc][1].meter.seconds = 0.0
        for _ in range(args.rounds):
            for rc in (False, True):
                for _ in range(args.steps):
                    step(rc)
        if rank == world - 1:
            off, on = statistics.median(runs[False][3]), statistics.median(runs[True][3])
            per = [statistics.median(runs[True][3][i:i + args.steps]) / statistics.median(runs[False][3][i:i + args.steps])
                   for i in range(0, len(runs[True][3]), args.steps)]
            link = f", link {args.bandwidth / 1e6:.0f} MB/s" if args.bandwidth else ""
            print(f"{world} processes{link}, chunks {chunks}: step {off:.3f} s with {args.knob}=False, {on:.3f} s with "
                  f"{args.knob}=True: {on / off:.2f} x "
                  f"(per round: {', '.join(f'{r:.2f}' for r in per)}); means {statistics.mean(runs[False][3]):.3f} / "
                  f"{statistics.mean(runs[True][3]):.3f} s: "
                  f"{statistics.mean(runs[True][3]) / statistics.mean(runs[False][3]):.2f} x", flush=True)
            meter = runs[True][1].meter
            if args.knob == "staleness_meter":  # its own time, measured inside the step
                print(f"  the meter's own time on this rank: {meter.seconds / sum(runs[True][3]) * 100:.2f} % of its "
                      f"timed steps", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--degree", type=float, default=20.0)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--procs", type=int, default=2, help="pipeline stages, one process each")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="the model's dropout (> 0: the staleness meter probes every snapshot_period steps; the "
                        "mean ratio then counts them)")
    p.add_argument("--knob", default="recompute", help="the PipelineConfig field set False, then True")
    p.add_argument("--fixed", nargs="*", default=[], help="other boolean knobs held fixed, as name=0|1")
    p.add_argument("--bandwidth", type=float, default=0,
                   help="simulated link in bytes/s (PYG_PIPE_SIMULATED_BANDWIDTH; 0: loopback as it is)")
    args = p.parse_args()
    if args.bandwidth:
        os.environ["PYG_PIPE_SIMULATED_BANDWIDTH"] = str(args.bandwidth)
    from tests.dist import run_distributed
    run_distributed(_worker, args.procs, args, timeout=3000)


if __name__ == "__main__":
    main()
