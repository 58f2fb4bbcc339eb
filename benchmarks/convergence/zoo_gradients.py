"""How far chunks take each PyG conv class's training gradient from the exact one, layer by layer.

The zoo's three-layer models (``tests/zoo.py``) on ``zoo_accuracy.py``'s community graph, at their initial
weights: the engine with C chunks (one process, one stage, ``streaming=False``: history for the other chunks'
rows, the defaults' T1-T3) against plain PyG on the whole graph. At lr = 0 the forward is exact, so what
differs is the backward alone: gradients of stale reads dropped, of fresh cross-chunk reads doubled (T3).
For each module group (``lin_in``, ``convs.0`` .. ``convs.2``, ``lin_out``)::

    error = |g_engine - g_exact| / |g_exact|      over the group's parameters, mean over --steps steps

(each step draws another chunk order). The last conv and ``lin_out`` read no halo in their backward and
are exact; the error grows towards the input. Set beside ``zoo_accuracy.py``'s accuracy loss, it tells a layer
that loses accuracy because its gradient is far off from one that is sensitive to a small error.

``--noise REL`` measures that sensitivity without chunks: one process trains as in ``zoo_accuracy.py``, once as it
is and once with random noise added to the gradient of every group but the last conv and ``lin_out`` (the groups
chunks perturb), a Gaussian direction scaled to ``REL`` times the group's gradient norm, fresh every step::

    sensitivity = test accuracy with noise - test accuracy without       (mean over --seeds)

    python benchmarks/convergence/zoo_gradients.py --chunks 2 8 --out docs/results/zoo_gradients.json
    python benchmarks/convergence/zoo_gradients.py --cases PNAConv GCNConv --chunks 2
    python benchmarks/convergence/zoo_gradients.py --cases PNAConv GCNConv --noise 0.01 0.1 --seeds 0 1 2

``--drift`` measures the forward's side instead: the engine trains ``--epochs`` epochs (Adam 0.01, seed 0) with C
chunks and the staleness meter's drift per call site, ``|h_fresh - h_read| / |h_fresh|`` over the stale reads, is
summed over the steps (docs/gnnpipe.md, "Staleness you can see"), with the share of halo reads that are stale and
their mean age in updates.

    python benchmarks/convergence/zoo_gradients.py --cases LEConv GCNConv --drift --chunks 2 8
"""
import argparse
import copy
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def _groups(net) -> dict:
    """Parameter names by module group: ``convs.1.lin.weight`` -> ``convs.1``, ``lin_in.bias`` -> ``lin_in``."""
    out = {}
    for name, _ in net.named_parameters():
        parts = name.split(".")
        out.setdefault(".".join(parts[:2]) if parts[0] == "convs" else parts[0], []).append(name)
    return out


def _loss_grad(net, data, inputs) -> dict:
    import torch.nn.functional as F
    net.zero_grad()
    out = net(data.x, **inputs)
    F.cross_entropy(out[data.train_mask], data.y[data.train_mask]).backward()
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def measure(name: str, data, inputs, chunks: int, steps: int, seed: int = 0) -> dict:
    """Relative gradient error per module group (mean over ``steps`` engine steps after the exact fill)."""
    import torch

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from tests.zoo import ZooNet
    torch.manual_seed(seed)
    ref = ZooNet(name, c_in=data.x.size(1), c_out=8)
    net = copy.deepcopy(ref)
    exact = _loss_grad(ref, data, inputs)
    engine = GNNPipeEngine(net, PipelineConfig(num_chunks=chunks, balance="layers", streaming=False, seed=seed),
                           Comm(torch.device("cpu")), num_stages=1, ways=1)
    engine.install()
    try:
        _loss_grad(net, data, inputs)  # the first step fills the history exactly
        got = [_loss_grad(net, data, inputs) for _ in range(steps)]
    finally:
        engine.uninstall()
    errors = {}
    for group, names in _groups(ref).items():
        names = [n for n in names if n in exact]
        if not names:
            continue
        g0 = torch.cat([exact[n].flatten() for n in names])
        errs = [float((torch.cat([g[n].flatten() for n in names]) - g0).norm() / g0.norm().clamp_min(1e-30))
                for g in got]
        errors[group] = sum(errs) / len(errs)
    return errors


def noise_sensitivity(name: str, data, inputs, rels, seeds, epochs: int) -> dict:
    """Test accuracy of one process per seed, as it is (``"0"``) and with gradient noise of each ``rels``."""
    import torch

    from tests.zoo import ZooNet
    from zoo_accuracy import train

    def perturber(rel: float, gen: torch.Generator):
        def perturb(net):
            params = dict(net.named_parameters())
            for group, names in _groups(net).items():
                if group in ("lin_out", "convs.2"):
                    continue
                grads = [params[n].grad for n in names if params[n].grad is not None]
                if not grads:
                    continue
                noise = [torch.randn(g.shape, generator=gen) for g in grads]
                scale = rel * torch.cat([g.flatten() for g in grads]).norm() / \
                    torch.cat([z.flatten() for z in noise]).norm()
                for g, z in zip(grads, noise):
                    g.add_(z, alpha=float(scale))
        return perturb

    out = {str(r): [] for r in [0.0, *rels]}
    for seed in seeds:
        torch.manual_seed(seed)
        init = ZooNet(name, c_in=data.x.size(1), c_out=8)
        for r in [0.0, *rels]:
            torch.manual_seed(1000 + seed)
            perturb = perturber(r, torch.Generator().manual_seed(seed)) if r else None
            out[str(r)].append(train(copy.deepcopy(init), data, inputs, epochs, perturb=perturb)["test"])
    return out


def drift(name: str, data, inputs, chunks: int, epochs: int) -> dict:
    """The staleness meter's summary over ``epochs`` training steps with ``chunks`` chunks."""
    import torch
    import torch.nn.functional as F

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from pyg_pipe.engine.runtime.staleness import summarize
    from tests.zoo import ZooNet
    torch.manual_seed(0)
    net = ZooNet(name, c_in=data.x.size(1), c_out=8)
    engine = GNNPipeEngine(net, PipelineConfig(num_chunks=chunks, balance="layers", streaming=False),
                           Comm(torch.device("cpu")), num_stages=1, ways=1)
    engine.install()
    steps = []
    try:
        torch.manual_seed(1000)
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        for _ in range(epochs):
            out = net(data.x, **inputs)
            loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += engine.meter.take()
    finally:
        engine.uninstall()
    return summarize(steps)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=None, help="zoo case names (default: all)")
    p.add_argument("--chunks", nargs="+", type=int, default=[2, 8])
    p.add_argument("--nodes", type=int, default=1200)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--noise", nargs="*", type=float, default=None,
                   help="measure the sensitivity to gradient noise of these relative sizes instead")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="(--noise) seeds")
    p.add_argument("--epochs", type=int, default=100, help="(--noise, --drift) epochs")
    p.add_argument("--drift", action="store_true", help="measure the forward's drift per call site instead")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import logging

    import torch

    from tests.zoo import ZOO
    from zoo_accuracy import community, save
    logging.getLogger("pyg_pipe").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    data, inputs = community(args.nodes)
    results = {}
    if args.drift:
        print("| layer | chunks | drift per site, first to last | stale share | mean age |")
        print("|---|---:|---|---:|---:|")
        for name in args.cases or list(ZOO):
            for c in args.chunks:
                try:
                    r = results.setdefault(name, {})[str(c)] = drift(name, data, inputs, c, args.epochs)
                except Exception as e:  # a refusal is part of the table
                    results.setdefault(name, {})[str(c)] = f"{type(e).__name__}: {str(e)[:160]}"
                    print(f"| {name} | {c} | {str(e)[:50]} | | |", flush=True)
                    continue
                sites = " / ".join(f"{v:.2f}" for k, v in r.items() if k.startswith("drift/"))
                print(f"| {name} | {c} | {sites} | {r['stale_share']:.2f} | {r['mean_age']:.1f} |", flush=True)
        save(args, results)
        return
    if args.noise:
        import statistics
        print("| layer | one process | " + " | ".join(f"noise {r:g} (Δ points)" for r in args.noise) + " | s |")
        print("|---|---:|" + "---:|" * len(args.noise) + "---:|")
        for name in args.cases or list(ZOO):
            t0 = time.perf_counter()
            r = results[name] = noise_sensitivity(name, data, inputs, args.noise, args.seeds, args.epochs)
            one = statistics.mean(r["0.0"])
            cells = [f"{statistics.mean(r[str(x)]):.3f} ({100 * (statistics.mean(r[str(x)]) - one):+.1f})"
                     for x in args.noise]
            print(f"| {name} | {one:.3f} | " + " | ".join(cells) + f" | {time.perf_counter() - t0:.0f} |", flush=True)
        save(args, results)
        return
    print("| layer | " + " | ".join(f"{c} chunks: error of lin_in / convs.0 / convs.1" for c in args.chunks) + " | s |")
    print("|---|" + "---|" * len(args.chunks) + "---:|")
    for name in args.cases or list(ZOO):
        t0 = time.perf_counter()
        row = results[name] = {}
        for c in args.chunks:
            try:
                row[str(c)] = measure(name, data, inputs, c, args.steps)
            except Exception as e:  # a refusal is part of the table
                row[str(c)] = f"{type(e).__name__}: {str(e)[:160]}"
        cells = [v[:50] if isinstance(v, str) else " / ".join(f"{v.get(g, float('nan')):.2f}"
                                                              for g in ("lin_in", "convs.0", "convs.1"))
                 for v in (row[str(c)] for c in args.chunks)]
        print(f"| {name} | " + " | ".join(cells) + f" | {time.perf_counter() - t0:.0f} |", flush=True)
    save(args, results)


if __name__ == "__main__":
    main()
