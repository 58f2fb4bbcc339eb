"""What chunks cost each PyG conv class in accuracy: the zoo's three-layer models (``tests/zoo.py``, every conv
class as a user would stack it) trained on a generated community graph, one process against the engine with C
chunks (history for the other chunks' rows, T1-T3 on, the defaults), over several seeds.

One process with one stage and C chunks (``streaming=False``) reads history as gnnpipe does with C chunks a
way on its stages: whether a read is fresh depends on the chunks' clocks only (``tasks.py``; docs/convergence.md).
So this measures what staleness costs each layer, many cases in one process.

* graph: ``sbm_graph`` with many small communities (homophily 0.8, weak features: the neighbours are needed),
  and random edge weights, edge features, two edge types and 3-d positions for the layers that take them;
* training: Adam (``--lr``, 0.01), full graph, ``--epochs`` epochs; the test accuracy at the epoch of the best validation
  accuracy (evaluated exactly: inference with chunks is exact);
* a layer the engine refuses is listed with the start of its message.

    python benchmarks/convergence/zoo_accuracy.py --chunks 4 8 --seeds 0 1 2 --out docs/results/zoo_accuracy.json
    python benchmarks/convergence/zoo_accuracy.py --cases GCNConv GATConv --chunks 8 --seeds 0   # a few
    python benchmarks/convergence/zoo_accuracy.py --cases ChebConv --config '{"max_age": 0}'     # other knobs
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def community(nodes: int, seed: int = 0):
    """The graph and every edge tensor the zoo's layers take (``tests.zoo.ZooNet``'s forward arguments)."""
    import torch

    from pyg_pipe.graph import sbm_graph
    data = sbm_graph(nodes, num_classes=max(nodes // 60, 8), avg_degree=6, homophily=0.8, num_features=32,
                     feature_noise=1.5, seed=seed)
    data.y = data.y % 8
    gen = torch.Generator().manual_seed(seed)
    E = data.edge_index.size(1)
    inputs = dict(edge_index=data.edge_index, edge_weight=torch.rand(E, generator=gen) + 0.5,
                  edge_attr=torch.randn(E, 3, generator=gen), edge_type=torch.randint(0, 2, (E,), generator=gen),
                  pos=torch.randn(nodes, 3, generator=gen))
    return data, inputs


def train(net, data, inputs, epochs: int, lr: float = 0.01, perturb=None) -> dict:
    """Test accuracy at the best validation epoch, and the last epoch's loss. ``perturb(net)``, if given, runs
    between the backward and the optimizer's step (``zoo_gradients.py`` adds noise to the gradients there)."""
    import torch
    import torch.nn.functional as F
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    best_val, test, loss = -1.0, 0.0, float("nan")
    for _ in range(epochs):
        net.train()
        out = net(data.x, **inputs)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        if perturb is not None:
            perturb(net)
        opt.step()
        net.eval()
        with torch.no_grad():
            pred = net(data.x, **inputs).argmax(-1)
        val = float((pred[data.val_mask] == data.y[data.val_mask]).float().mean())
        if val > best_val:
            best_val, test = val, float((pred[data.test_mask] == data.y[data.test_mask]).float().mean())
    return {"test": test, "val": best_val, "loss": float(loss.detach()) if torch.is_tensor(loss) else loss}


def run_case(name: str, data, inputs, chunks, seeds, epochs: int, config: dict = None, lr: float = 0.01) -> dict:
    import torch

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from tests.zoo import ZooNet
    out = {"one": [], **{str(c): [] for c in chunks}}
    for seed in seeds:
        torch.manual_seed(seed)
        init = ZooNet(name, c_in=data.x.size(1), c_out=8)
        torch.manual_seed(1000 + seed)
        out["one"].append(train(copy.deepcopy(init), data, inputs, epochs, lr)["test"])
        for c in chunks:
            net = copy.deepcopy(init)
            engine = GNNPipeEngine(net, PipelineConfig(num_chunks=c, balance="layers", streaming=False,
                                                               **(config or {})),
                                   Comm(torch.device("cpu")), num_stages=1, ways=1)
            engine.install()
            try:
                torch.manual_seed(1000 + seed)
                out[str(c)].append(train(net, data, inputs, epochs, lr)["test"])
            except Exception as e:  # a refusal (or a failure) is part of the table
                out[str(c)] = f"{type(e).__name__}: {str(e)[:160]}"
                return out
            finally:
                engine.uninstall()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=None, help="zoo case names (default: all)")
    p.add_argument("--chunks", nargs="+", type=int, default=[4, 8])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--nodes", type=int, default=1200)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate")
    p.add_argument("--config", type=json.loads, default={},
                   help='engine knobs as JSON, e.g. \'{"max_age": 0}\' or \'{"late_gradients": true}\'')
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import logging

    import torch

    from tests.zoo import ZOO
    logging.getLogger("pyg_pipe").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    data, inputs = community(args.nodes)
    names = args.cases or list(ZOO)
    results = {}
    print("| layer | one process | " + " | ".join(f"{c} chunks (Δ points)" for c in args.chunks) + " | s |")
    print("|---|---:|" + "---:|" * len(args.chunks) + "---:|")
    for name in names:
        t0 = time.perf_counter()
        r = results[name] = run_case(name, data, inputs, args.chunks, args.seeds, args.epochs,
                                              args.config, args.lr)
        one = statistics.mean(r["one"])
        cells = []
        for c in args.chunks:
            v = r[str(c)]
            cells.append(v[:60] if isinstance(v, str) else f"{statistics.mean(v):.3f} ({100 * (statistics.mean(v) - one):+.1f})")
        print(f"| {name} | {one:.3f} | " + " | ".join(cells) + f" | {time.perf_counter() - t0:.0f} |", flush=True)
    save(args, results)


def save(args, results: dict) -> None:
    """Writes ``results`` with the command's settings to ``args.out`` (when given); ``zoo_gradients.py`` too."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"setting": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
