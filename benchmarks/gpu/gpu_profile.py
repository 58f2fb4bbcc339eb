"""Where one GPU's training step goes: plain PyG against the engine streaming over chunks (NGra), profiled.

On one GPU with several chunks the engine streams the graph chunk by chunk; on the first GPU run that
epoch took 11x (4 chunks) and 22x (8 chunks) plain PyG's on a 20k-vertex graph. This script profiles a
few steps of each with ``torch.profiler`` (CPU and CUDA activities) and prints, side by side:

* wall time per step, and the GPU's busy time per step (sum of kernel and copy times): the gap is the
  GPU idling on the host (Python, launches, synchronisations);
* the calls that make the host wait: ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize``,
  ``aten::item`` / ``aten::_local_scalar_dense``, and host-device copies (count and bytes);
* the operators with the most host time.

    python benchmarks/gpu/gpu_profile.py --nodes 20000 --layers 16 --chunks 4 --steps 3
    python benchmarks/gpu/gpu_profile.py --nodes 200000 --layers 16 --chunks 4 --steps 3

Needs a CUDA device (``bash benchmarks/gpu.sh`` runs it); a measurement, never a test.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
         "aten::_local_scalar_dense")


def step_fn(model, data, graph):
    import torch
    import torch.nn.functional as F
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step():
        out = model(data.x, graph)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def profile(step, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as prof
    for _ in range(2):  # warm-up: caches, the kernels' transposed graphs, the engine's plan
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = p.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") \
        if hasattr(events[0], "self_device_time_total") else float("nan")
    syncs = {e.key: e.count // steps for e in events if e.key in SYNCS}
    copies = {e.key: e.count // steps for e in events if "Memcpy" in e.key or "memcpy" in e.key}
    top = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)[:15]
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"),
                     key=lambda e: -getattr(e, "self_device_time_total", 0))[:15]
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": gpu_us / 1e3 / steps, "syncs_per_step": syncs,
            "copies_per_step": copies,
            "top_host_ops": [(e.key, e.count // steps, round(e.self_cpu_time_total / 1e3 / steps, 3))
                             for e in top],
            "top_gpu_kernels": [(e.key[:120], e.count // steps, round(getattr(e, "self_device_time_total", 0) / 1e3
                                                                        / steps, 3)) for e in kernels]}


def main() -> None:
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=20_000)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--chunks", type=int, nargs="+", default=[4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu/gpu_profile.py: no CUDA device here; nothing to run.")
        return
    import copy

    from benchmarks.speed.gnnpipe_epoch import build
    from pyg_pipe import ops
    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig

    ns = argparse.Namespace(graph="community", nodes=args.nodes, degree=20.0, features=64, classes=8,
                            model="gcnii", layers=args.layers, hidden=64)
    data, model = build(ns)
    data, model = data.to("cuda"), model.to("cuda")
    results = {"nodes": args.nodes, "layers": args.layers, "device": torch.cuda.get_device_name()}
    results["plain"] = profile(step_fn(copy.deepcopy(model), data, data.adj_t), args.steps)
    for chunks in args.chunks:
        m = copy.deepcopy(model)
        engine = GNNPipeEngine(m, PipelineConfig(num_chunks=chunks), Comm(torch.device("cuda")), num_stages=1)
        engine.install()
        try:
            with ops.fused_kernels():
                results[f"streaming_{chunks}"] = profile(step_fn(m, data, data.adj_t), args.steps)
        finally:
            engine.uninstall()
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        print(f"\n== {name}: wall {r['wall_ms']:.1f} ms/step, GPU busy {r['gpu_busy_ms']:.1f} ms/step "
              f"({r['gpu_busy_ms'] / r['wall_ms']:.0%})")
        print(f"   host waits per step: {r['syncs_per_step']}; copies per step: {r['copies_per_step']}")
        for key, count, ms in r["top_host_ops"]:
            print(f"   {key[:60]:60} x{count:<6} {ms:8.2f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
