"""Where a streamed step's GPU memory goes: the live allocations at the step's peak (or at an out-of-memory
error), grouped by the line of pyg_pipe / PyG / the model that made them.

    python benchmarks/gpu/gpu_memory_probe.py --nodes 200000 --cap-gib 2 --out docs/results/gpu/memory_probe.json

One streamed training step of the GCNII of :mod:`benchmarks.gpu.gpu_summary` (random 8-block graph, contiguous
chunks, every value between layers in pinned host memory) with ``torch.cuda.memory``'s allocation history
on; the snapshot is taken at the error, or after the step at the largest live total seen. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _where(frames) -> str:
    """The deepest frame in pyg_pipe, else in torch_geometric, else the first Python frame."""
    for key in ("pyg_pipe/", "torch_geometric/", "benchmarks/"):
        for f in frames:
            if key in f.get("filename", ""):
                return f"{f['filename'].split(key)[-1]}:{f['line']} {f.get('name', '')}"
    f = frames[0] if frames else {}
    return f"{f.get('filename', '?')}:{f.get('line', '?')}"


def summarize(snap: dict, top: int = 20) -> dict:
    by_site, total = defaultdict(lambda: [0, 0]), 0
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            site = _where(b.get("frames", []))
            by_site[site][0] += b["size"]
            by_site[site][1] += 1
            total += b["size"]
    rows = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    return {"live_mb": total / 2**20,
            "top": [{"where": k, "mb": round(v[0] / 2**20, 1), "blocks": v[1]} for k, v in rows]}


def main() -> None:
    import torch
    from benchmarks.gpu.gpu_summary import _Engine, _ns, _step_fn
    from benchmarks.speed.gnnpipe_epoch import build
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[100_000, 200_000])
    p.add_argument("--cap-gib", type=float, default=2.0)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu/gpu_memory_probe.py: no CUDA device here; nothing to run.")
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, args.cap_gib * 2**30 / torch.cuda.get_device_properties(dev).total_memory), dev.index)
    results = []
    for nodes in args.nodes:
        data, model = build(_ns(nodes, graph="random"))
        data, model = data.to(dev), model.to(dev)
        graph_mb = torch.cuda.memory_allocated(dev) / 2**20
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
        r = {"nodes": nodes, "chunks": args.chunks, "graph_and_model_mb": graph_mb}
        try:
            with _Engine(model, dev, num_chunks=args.chunks, offload="host", offload_budget=0,
                         partition="contiguous"):
                step = _step_fn(model, data)
                step()
                r["after_first_step_mb"] = torch.cuda.memory_allocated(dev) / 2**20
                r["peak_first_step_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
                torch.cuda.reset_peak_memory_stats(dev)
                step()
                r["peak_second_step_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
                r["at_end"] = summarize(torch.cuda.memory._snapshot())
                r["ok"] = True
        except torch.OutOfMemoryError as exc:
            r["ok"], r["error"] = False, str(exc)[:300]
            r["peak_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
            r["at_error"] = summarize(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
        del data, model
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
