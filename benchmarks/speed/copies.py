"""Row copies per (chunk, layer): how many gathers, joins and copies one training step makes, and where.

Every tensor operation that copies rows (``copy_``, ``index_select``, ``index``, ``cat``, ``index_copy_``,
``clone``, ``_to_copy``, ``index_put_``, and the backward of a slice or of a selected row, ``slice_backward`` /
``select_backward``: a zero-filled gradient of the whole tensor with the slice's copied in) is counted through a
``TorchDispatchMode`` during one training step (forward and backward) of a 16-layer GCNII on one process with C
chunks, by the innermost line of pyg_pipe or PyG that made it; the total is divided by C x L. On a GPU each of
these is a device copy (a kernel launch), so this is the count the GPU profile reports (docs/benchmarks.md, "On a
GPU"), measured on the CPU; the plain block copies among them (``memcpys_per_step``) are what the profile lists as
``Memcpy DtoD``, the rest are kernels.

    python benchmarks/speed/copies.py                      # streaming (NGra) and history, 4 chunks
    python benchmarks/speed/copies.py --nodes 20000 --chunks 8 --out copies.json
    python benchmarks/speed/copies.py --adj-t                 # adj_t and the fused kernels, as on the GPU
    python benchmarks/speed/copies.py --adj-t --device cuda   # the same operations counted on a GPU
"""
import argparse
import collections
import contextlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

COPIES = {"copy_", "index_select", "cat", "index_copy_", "clone", "index", "_to_copy", "index_put_", "slice_backward",
          "select_backward"}


def _memcpy(name: str, args) -> bool:
    """Whether the operation is (or contains) a plain block copy, one ``Memcpy DtoD`` on a GPU: ``copy_`` between
    contiguous tensors of one shape and dtype, ``clone``, and a slice's or a selected row's backward (the slice's
    gradient copied into zeros)."""
    if name == "copy_":
        dst, src = args[0], args[1]
        return dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()
    return name in ("clone", "slice_backward", "select_backward")


def count(streaming: bool, nodes: int, chunks: int, layers: int, adj_t: bool = False, device: str = "cpu") -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from pyg_pipe.graph import sbm_graph
    from pyg_pipe.models import gcnii

    data = sbm_graph(nodes, num_classes=4, avg_degree=8, num_features=16, seed=0)
    torch.manual_seed(0)
    model = gcnii(16, 32, 4, num_layers=layers, dropout=0.0, cached=adj_t)
    graph = data.edge_index
    kernels = contextlib.nullcontext()
    if adj_t:  # as the GPU summary runs it: a CSR adjacency through the fused kernels
        from torch_geometric.utils import to_torch_csr_tensor

        from pyg_pipe import ops
        graph = to_torch_csr_tensor(data.edge_index.flip(0), size=(nodes, nodes))
        kernels = ops.fused_kernels()
    kernels.__enter__()
    dev = torch.device(device)
    data, model, graph = data.to(dev), model.to(dev), graph.to(dev)
    # (on a GPU uncaptured: a replayed CUDA graph dispatches no operation to count; the capture holds the same ones)
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, streaming=streaming, cuda_graphs=False), Comm(dev),
                           num_stages=1)
    engine.install()

    def step():
        out = model(data.x, graph)
        F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()

    for _ in range(3):  # planning, the history pass, kept inputs: a steady step is counted
        step()
    where = collections.Counter()
    memcpys = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if _memcpy(name, args):
                memcpys[0] += 1
            if name in COPIES:
                frames = [f for f in traceback.extract_stack() if ("pyg_pipe" in f.filename
                          or "torch_geometric" in f.filename) and not f.filename.endswith("hash_tensor.py")]
                # (PyG wraps torch.index_select in hash_tensor.py: the line that called it is the one named)
                at = "autograd"
                if frames:
                    f = frames[-1].filename
                    at = f"{f[f.rindex('pyg_pipe/') if 'pyg_pipe/' in f else f.rindex('torch_geometric/'):]}:" \
                         f"{frames[-1].lineno} ({frames[-1].name})"
                where[f"{name} {at}"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    engine.uninstall()
    kernels.__exit__(None, None, None)
    total = sum(where.values())
    return {"mode": "streaming" if streaming else "history", "input": "adj_t" if adj_t else "edge_index",
            "device": device, "nodes": nodes, "chunks": chunks, "layers": layers,
            "copies_per_step": total, "per_chunk_layer": total / (chunks * layers), "memcpys_per_step": memcpys[0],
            "sites": dict(where.most_common())}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4000)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--adj-t", action="store_true", help="a CSR adjacency through the fused kernels (as gpu_summary.py)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (on a GPU the step runs uncaptured)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    results = [count(s, args.nodes, args.chunks, args.layers, args.adj_t, args.device) for s in (True, False)]
    for r in results:
        print(f"{r['mode']}: {r['copies_per_step']} row copies per step, {r['per_chunk_layer']:.2f} per (chunk, layer); "
              f"{r['memcpys_per_step']} of them plain memory copies")
        for site, n in list(r["sites"].items())[:6]:
            print(f"  {n:5d}  {site}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
