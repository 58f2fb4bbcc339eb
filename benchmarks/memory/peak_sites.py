"""What is live at a training step's memory peak, by the code that allocated it, on every rank.

Runs the 16-layer GCNII of ``benchmarks/speed/gnnpipe_epoch.py`` on its community graph through a real
Lightning Trainer (2 processes, gloo), records every CPU allocation and free with the PyTorch profiler
from the start of step ``--start`` to the end of step ``--step``, replays them in order, and at the
largest sum reached during step ``--step`` lists the live bytes grouped by allocating operator and the
nearest Python frames of pyg_pipe, PyG and this script. With ``--start 0`` the engine's persistent
structures (the plan, the chunked graphs, history, caches: built in the first step) are in the picture;
with ``--start`` equal to ``--step`` only what the step itself allocated.

    python benchmarks/memory/peak_sites.py                          # 2 chunks, steps 0-3
    python benchmarks/memory/peak_sites.py --chunks 4 --start 3 --step 3
    python benchmarks/memory/peak_sites.py --mode graph_parallel

Memory allocated before ``--start`` (the data, the model, Lightning) is not counted; the sums are the
allocator's bytes, not the resident set. The walk uses the profiler's event tree
(``kineto_results.experimental_event_tree``, a private API of PyTorch 2.x): a diagnostic, not a test.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

KEEP = ("pyg_pipe", "torch_geometric", "peak_sites")


def _name(event) -> str:
    try:
        return event.name
    except UnicodeDecodeError:  # a few recorded names are not valid UTF-8
        return "?"


def _site(event, depth: int) -> str:
    """The allocating operator and the nearest ``depth`` Python frames of interest above it."""
    from torch._C._profiler import _EventType

    out, e = [], event.parent
    while e is not None and len(out) < depth:
        if e.typed[0] == _EventType.PyCall:
            name = _name(e)
            if any(k in name for k in KEEP):
                out.append(name.split("/")[-1])
        elif e.typed[0] == _EventType.TorchOp and not out:
            out.append(_name(e))
        e = e.parent
    return " < ".join(out)


def live_at_peak(prof, marker: str, depth: int):
    """``(peak bytes, {site: bytes})`` at the largest live sum after the ``marker`` range began."""
    from torch._C._profiler import _EventType

    events, begin = [], [None]

    def walk(e):
        if _name(e) == marker:
            begin[0] = e.start_time_ns
        if e.typed[0] == _EventType.Allocation:
            events.append((e.start_time_ns, e.typed[1].ptr, e.typed[1].alloc_size, e))
        for c in e.children:
            walk(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort(key=lambda t: t[0])
    live, cur, peak, at = {}, 0, 0, {}
    for t, ptr, size, e in events:
        if size > 0:
            live[ptr] = (size, e)
            cur += size
        elif ptr in live:
            cur -= live.pop(ptr)[0]
        if cur > peak and begin[0] is not None and t >= begin[0]:
            peak, at = cur, dict(live)
    sites = collections.Counter()
    for size, e in at.values():
        sites[_site(e, depth)] += size
    return peak, sites


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["gnnpipe", "graph_parallel"], default="gnnpipe")
    p.add_argument("--chunks", default="2", help="num_chunks (an integer or 'auto')")
    p.add_argument("--recompute", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--start", type=int, default=0, help="the first step recorded")
    p.add_argument("--step", type=int, default=3, help="the step whose peak is listed")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--depth", type=int, default=4, help="Python frames shown per site")
    args = p.parse_args()

    import lightning.pytorch as pl
    import torch
    from torch.profiler import ProfilerActivity, profile

    import pyg_pipe
    from benchmarks.speed import gnnpipe_epoch as ge

    torch.set_num_threads(1)
    setting = argparse.Namespace(graph="community", nodes=args.nodes, degree=20.0, features=64, classes=8,
                                 model="gcnii", layers=args.layers, hidden=64)
    data, model = ge.build(setting)

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, *a):
            if trainer.global_step == args.start:
                self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True)
                self.prof.__enter__()
            if trainer.global_step == args.step:
                self.mark = torch.profiler.record_function("peak_sites: measured step")
                self.mark.__enter__()

        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step - 1 != args.step:
                return
            self.mark.__exit__(None, None, None)
            self.prof.__exit__(None, None, None)
            peak, sites = live_at_peak(self.prof, "peak_sites: measured step", args.depth)
            lines = [f"rank {trainer.global_rank}: {peak / 2**20:.1f} MB live at the peak of step {args.step} "
                     f"(allocated since step {args.start})"]
            lines += [f"  {b / 2**20:8.1f} MB  {s}" for s, b in sites.most_common(args.top)]
            print("\n".join(lines), flush=True)

    chunks = args.chunks if args.chunks == "auto" else int(args.chunks)
    recompute = {"on": True, "off": False}.get(args.recompute, "auto")
    strategy = pyg_pipe.GNNPipeStrategy(num_chunks=chunks, grid="pipeline", recompute=recompute) \
        if args.mode == "gnnpipe" else pyg_pipe.GraphParallelStrategy()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=args.step + 2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[Record()])
    trainer.fit(ge.node_classifier(model), datamodule=pyg_pipe.FullGraphDataModule(data))


if __name__ == "__main__":
    main()
