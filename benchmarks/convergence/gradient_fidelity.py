"""How close gnnpipe's training gradient is to the exact one, step by step, under each staleness mode.

At every step the engine's gradient (historical rows, the freshness policy, T1-T3, the bound) is compared
with the gradient plain PyG computes at the same weights on the whole graph (a copy of the model given the
engine's weights before the optimizer moves them)::

    cosine = <g_engine, g_exact> / (|g_engine| |g_exact|)        norm ratio = |g_engine| / |g_exact|

together with the training loss the engine saw against the exact loss, and validation / test accuracy.
It runs in one process with one stage and ``streaming=False``, so the chunks of one way read history as on
a pipeline: whether a read is fresh depends on the chunks' clocks only, not on which stage runs the layer
(:mod:`pyg_pipe.engine.plan.schedule`). Graphs, models and modes are those of ``convergence.py``; dropout follows
``PYG_PIPE_BENCH_DROPOUT`` (default 0 here, so the exact gradient is deterministic).

    python benchmarks/convergence/gradient_fidelity.py --model resgcn --modes t1-t3 age0 age1 age11 \\
        --out docs/results/gradient_fidelity_resgcn.json
    python benchmarks/convergence/gradient_fidelity.py --plot docs/results/gradient_fidelity_resgcn.json \
        docs/img/gradient_fidelity_resgcn.png        # the exact loss and the cosine per step, per mode
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

os.environ.setdefault("PYG_PIPE_BENCH_DROPOUT", "0")  # read by convergence.py at import

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import convergence  # noqa: E402  (graphs, models, modes and accuracy of the convergence study)


def _flat_grad(module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in module.parameters()])


def run(model_name: str, graph_name: str, mode: str, chunks: int, epochs: int, nodes: int, layers: int,
        seed: int, lr: float = 0.005) -> list:
    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    data = convergence.graph(graph_name, nodes)
    net = convergence.model(model_name, layers, seed)
    exact = copy.deepcopy(net)
    engine = None
    if mode != "one-process":
        cfg = PipelineConfig(num_chunks=chunks, balance="layers", seed=seed, streaming=False,
                             **convergence.MODES[mode])
        engine = GNNPipeEngine(net, cfg, Comm(torch.device("cpu")), num_stages=1)
        engine.install()
    torch.manual_seed(seed + 1)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    rows = []
    for _ in range(epochs):
        net.train()
        loss = F.cross_entropy(net(data.x, data.edge_index)[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        exact.load_state_dict(net.state_dict())
        exact.train()
        exact.zero_grad()
        exact_loss = F.cross_entropy(exact(data.x, data.edge_index)[data.train_mask], data.y[data.train_mask])
        exact_loss.backward()
        g, ge = _flat_grad(net), _flat_grad(exact)
        row = {"loss": float(loss.detach()), "exact_loss": float(exact_loss.detach()),
               "cosine": float(F.cosine_similarity(g, ge, 0)), "norm_ratio": float(g.norm() / ge.norm())}
        opt.step()
        net.eval()
        with torch.no_grad():
            row["val"], row["test"] = convergence.accuracies(net(data.x, data.edge_index), data)
        row["refreshes"] = engine.meter.refreshes if engine is not None else 0
        if engine is not None:
            engine.meter.take()
        rows.append(row)
    if engine is not None:
        engine.uninstall()
    return rows


def summary(rows: list) -> dict:
    test, best = convergence.summary(rows)
    cos = [r["cosine"] for r in rows]
    return {"test_at_best_val": test, "best_epoch": best, "median_cosine": statistics.median(cos),
            "min_cosine": min(cos), "median_norm_ratio": statistics.median(r["norm_ratio"] for r in rows),
            "max_exact_loss_rise": max(max(b["exact_loss"] - a["exact_loss"] for a, b in zip(rows, rows[1:])), 0.0),
            "refreshes": rows[-1]["refreshes"]}


def plot(path: str, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        d = json.load(f)
    fig, (ax_loss, ax_cos) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (mode, r) in enumerate(d["results"].items()):
        curve = r["curve"]
        ax_loss.plot([c["exact_loss"] for c in curve], color=f"C{i}",
                     label=f"{mode} ({r['summary']['test_at_best_val']:.3f})")
        if mode != "one-process":
            ax_cos.plot([c["cosine"] for c in curve], color=f"C{i}", label=mode)
    a = d["args"]
    ax_loss.set(xlabel="step", ylabel="exact training loss at the step's weights", yscale="log",
                title=f"{a['model']}, {a['chunks']} chunks, Adam lr {a['lr']} (test accuracy)")
    ax_cos.set(xlabel="step", ylabel="cosine(gnnpipe gradient, exact gradient)", ylim=(-0.3, 1.05),
               title="gradient against the exact one")
    ax_loss.legend(fontsize=8)
    ax_cos.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resgcn", choices=["gcnii", "resgcn", "gat"])
    p.add_argument("--graph", default="community", choices=["community", "heterophilous"])
    p.add_argument("--modes", nargs="+", default=["t1-t3", "age0", "age1", "age11"], choices=list(convergence.MODES))
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--nodes", type=int, default=3000)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.005, help="Adam's learning rate (the convergence study's: 0.005)")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), help="draw a result file instead of running")
    args = p.parse_args()
    if args.plot:
        return plot(*args.plot)
    torch.set_num_threads(1)
    results = {}
    for mode in ["one-process"] + list(args.modes):
        rows = run(args.model, args.graph, mode, args.chunks, args.epochs, args.nodes, args.layers, args.seed, args.lr)
        results[mode] = {"summary": summary(rows), "curve": rows}
        s = results[mode]["summary"]
        print(f"{args.model} {args.graph} {args.chunks} chunks lr {args.lr} {mode:12s} test {s['test_at_best_val']:.3f}  "
              f"cosine median {s['median_cosine']:.3f} min {s['min_cosine']:.3f}  norm ratio "
              f"{s['median_norm_ratio']:.2f}  largest rise of the exact loss {s['max_exact_loss_rise']:.2f}  "
              f"refreshes {s['refreshes']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "dropout": convergence.DROPOUT, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
