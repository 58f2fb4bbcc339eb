"""Task metrics with chunks: link prediction's AUC, LightGCN's recall@20, GAE's and VGAE's AUC, the R-GCN example's
accuracy and DeepGraphInfomax's probe accuracy, one process against the engine with C chunks (history for the other
chunks' rows, T1-T3 on), on generated graphs (offline).

Whether a read is fresh depends on the chunks' clocks only, not on which stage runs the layer, so one process
with one stage and C chunks (``streaming=False``) reads history as gnnpipe does with C chunks on its stages
(docs/convergence.md, "gradient fidelity"); the metric is what gnnpipe's staleness costs this task.

* link prediction: PyG's link_pred model (2 GCN layers, encode / decode), a 2,708-vertex community graph,
  RandomLinkSplit 85/5/10, Adam 0.01, negatives seeded per step, test AUC after the epochs;
* recommendation: PyG's ``LightGCN`` (3 layers, 64 dimensions) on a generated user-item graph (1,000 users
  in 10 taste groups, 500 items), 20 % of each user's items held out, BPR loss with one random negative per
  positive, Adam 0.01, recall@20 over all items the user did not train on.

    python benchmarks/convergence/tasks.py --chunks 8 --seeds 0 1 2 --out docs/results/tasks.json
    python benchmarks/convergence/tasks.py --tasks gae_auc vgae_auc rgcn_accuracy infomax_accuracy --chunks 8 32
    python benchmarks/convergence/tasks.py --bytes --out docs/results/tasks_bytes.json   # bytes per step, 2 processes

``--bytes``: the bytes one training step sends, summed over 2 processes, by category, for both models in
``graph_parallel`` (2 ways) and ``gnnpipe`` (2 stages, 8 chunks), from the transport's counters.
"""
import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _engine(model, chunks):
    import torch

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    if chunks is None:
        return None
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, streaming=False), Comm(torch.device("cpu")),
                           num_stages=1)
    engine.install()
    return engine


def link_prediction(chunks, seed: int, epochs: int) -> float:
    import torch
    import torch.nn.functional as F
    from torch_geometric.data import Data
    from torch_geometric.nn import GCNConv
    from torch_geometric.transforms import RandomLinkSplit
    from torch_geometric.utils import negative_sampling
    from torchmetrics.functional.classification import binary_auroc

    from pyg_pipe.graph import sbm_graph

    class Net(torch.nn.Module):
        def __init__(self, i, h, o):
            super().__init__()
            self.conv1, self.conv2 = GCNConv(i, h), GCNConv(h, o)

        def encode(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

        def decode(self, z, edge_label_index):
            return (z[edge_label_index[0]] * z[edge_label_index[1]]).sum(dim=-1)

    g = sbm_graph(2708, num_classes=7, avg_degree=4, num_features=64, seed=0)
    torch.manual_seed(0)
    random.seed(0)
    train, _, test = RandomLinkSplit(num_val=0.05, num_test=0.1, is_undirected=True,
                                     add_negative_train_samples=False)(Data(x=g.x, edge_index=g.edge_index))
    torch.manual_seed(seed)
    model = Net(64, 128, 64)
    engine = _engine(model, chunks)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for epoch in range(epochs):
        z = model.encode(train.x, train.edge_index)
        torch.manual_seed(1000 * seed + epoch)
        random.seed(1000 * seed + epoch)
        neg = negative_sampling(train.edge_index, num_nodes=train.num_nodes, num_neg_samples=train.edge_index.size(1))
        label_index = torch.cat([train.edge_index, neg], dim=-1)
        label = torch.cat([torch.ones(train.edge_index.size(1)), torch.zeros(neg.size(1))])
        loss = F.binary_cross_entropy_with_logits(model.decode(z, label_index), label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        z = model.encode(train.x, train.edge_index)
        auc = float(binary_auroc(model.decode(z, test.edge_label_index).sigmoid(), test.edge_label.long()))
    if engine is not None:
        engine.uninstall()
    return auc


def recommendation(chunks, seed: int, epochs: int, users: int = 1000, items: int = 500, groups: int = 10) -> float:
    import torch
    from torch_geometric.nn import LightGCN

    gen = torch.Generator().manual_seed(0)
    taste = torch.randint(0, groups, (users,), generator=gen)
    kind = torch.randint(0, groups, (items,), generator=gen)
    pairs = []
    for u in range(users):
        liked = torch.nonzero(kind == taste[u]).view(-1)
        others = torch.nonzero(kind != taste[u]).view(-1)
        pick = liked[torch.randperm(liked.numel(), generator=gen)[:12]]
        noise = others[torch.randperm(others.numel(), generator=gen)[:3]]
        pairs += [(u, int(i)) for i in torch.cat([pick, noise])]
    pairs = torch.tensor(pairs).t()
    held = torch.rand(pairs.size(1), generator=gen) < 0.2
    train, test = pairs[:, ~held], pairs[:, held]
    n = users + items
    edge_index = torch.cat([torch.stack([train[0], train[1] + users]), torch.stack([train[1] + users, train[0]])], 1)
    torch.manual_seed(seed)
    model = LightGCN(n, 64, num_layers=3)
    engine = _engine(model, chunks)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(1000 * seed + epoch)
        pos = torch.stack([train[0], train[1] + users])
        neg = torch.stack([train[0], torch.randint(0, items, (train.size(1),), generator=g) + users])
        label_index = torch.cat([pos, neg], dim=1)
        pos_rank, neg_rank = model(edge_index, label_index).chunk(2)
        loss = model.recommendation_loss(pos_rank, neg_rank, node_id=label_index.unique())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        emb = model.get_embedding(edge_index)
    if engine is not None:
        engine.uninstall()
    scores = emb[:users] @ emb[users:].t()
    scores[train[0], train[1]] = float("-inf")  # items the user trained on are not recommended again
    top = scores.topk(20, dim=1).indices
    hits = torch.zeros(users, items, dtype=torch.bool)
    hits[test[0], test[1]] = True
    found = hits.gather(1, top).sum(1).float()
    want = hits.sum(1).float()
    has = want > 0
    return float((found[has] / want[has].clamp(max=20)).mean())


def autoencoder(chunks, seed: int, epochs: int, variational: bool = False) -> float:
    """PyG's autoencoder example (GAE / VGAE, a GCN encoder): test AUC of the held-out edges."""
    import torch
    from torch_geometric.data import Data
    from torch_geometric.nn import GAE, VGAE, GCNConv
    from torch_geometric.transforms import RandomLinkSplit
    from torchmetrics.functional.classification import binary_auroc

    from pyg_pipe.graph import sbm_graph

    class Encoder(torch.nn.Module):  # the example's GCNEncoder / VariationalGCNEncoder
        def __init__(self, i, o):
            super().__init__()
            self.conv1 = GCNConv(i, 2 * o)
            self.conv2 = GCNConv(2 * o, o)
            self.conv_logstd = GCNConv(2 * o, o) if variational else None

        def forward(self, x, edge_index):
            h = self.conv1(x, edge_index).relu()
            if self.conv_logstd is None:
                return self.conv2(h, edge_index)
            return self.conv2(h, edge_index), self.conv_logstd(h, edge_index)

    g = sbm_graph(2708, num_classes=7, avg_degree=4, num_features=64, seed=0)
    torch.manual_seed(0)
    train, _, test = RandomLinkSplit(num_val=0.05, num_test=0.1, is_undirected=True, split_labels=True,
                                     add_negative_train_samples=False)(Data(x=g.x, edge_index=g.edge_index))
    torch.manual_seed(seed)
    model = (VGAE if variational else GAE)(Encoder(64, 16))
    engine = _engine(model.encoder, chunks)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for epoch in range(epochs):
        z = model.encode(train.x, train.edge_index)
        torch.manual_seed(1000 * seed + epoch)  # recon_loss's negative samples
        loss = model.recon_loss(z, train.pos_edge_label_index)
        if variational:
            loss = loss + model.kl_loss() / train.num_nodes
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        z = model.encode(train.x, train.edge_index)
        pairs = torch.cat([test.pos_edge_label_index, test.neg_edge_label_index], 1)
        label = torch.cat([torch.ones(test.pos_edge_label_index.size(1)), torch.zeros(test.neg_edge_label_index.size(1))])
        auc = float(binary_auroc(model.decode(z, pairs, sigmoid=True), label.long()))
    if engine is not None:
        engine.uninstall()
    return auc


def relational(chunks, seed: int, epochs: int) -> float:
    """The typed graph of examples/heterogeneous.py (papers and authors, ``to_homogeneous()``) with its R-GCN: test
    accuracy of the papers."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "examples"))
    from heterogeneous import RGCN, academic_graph, homogeneous

    data = homogeneous(academic_graph())
    torch.manual_seed(seed)
    model = RGCN(data.num_features, 64, int(data.y.max()) + 1, int(data.edge_type.max()) + 1)
    engine = _engine(model, chunks)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    for epoch in range(epochs):
        torch.manual_seed(1000 * seed + epoch)
        out = model(data.x, data.edge_index, data.edge_type)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(data.x, data.edge_index, data.edge_type).argmax(-1)
    if engine is not None:
        engine.uninstall()
    return float((pred[data.test_mask] == data.y[data.test_mask]).float().mean())


def infomax(chunks, seed: int, epochs: int) -> float:
    """PyG's infomax_transductive example (DeepGraphInfomax, a GCN encoder with PReLU, its encoder called twice a
    step): test accuracy of a logistic regression on the embeddings (trained with torch: the example's scikit-learn
    regression is not installed here), the labels of the community graph."""
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import DeepGraphInfomax, GCNConv

    from pyg_pipe.graph import sbm_graph

    class Encoder(torch.nn.Module):
        def __init__(self, i, h):
            super().__init__()
            self.conv, self.prelu = GCNConv(i, h), torch.nn.PReLU(h)

        def forward(self, x, edge_index):
            return self.prelu(self.conv(x, edge_index))

    g = sbm_graph(2708, num_classes=7, avg_degree=4, num_features=64, seed=0)
    torch.manual_seed(seed)
    model = DeepGraphInfomax(128, encoder=Encoder(64, 128), summary=lambda z, *a, **k: z.mean(dim=0).sigmoid(),
                             corruption=lambda x, ei: (x[torch.randperm(x.size(0))], ei))
    engine = _engine(model.encoder, chunks)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)
    for epoch in range(epochs):
        torch.manual_seed(1000 * seed + epoch)  # the corruption's permutation
        loss = model.loss(*model(g.x, g.edge_index))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        z = model(g.x, g.edge_index)[0]
    if engine is not None:
        engine.uninstall()
    torch.manual_seed(0)
    probe = torch.nn.Linear(z.size(1), int(g.y.max()) + 1)
    popt = torch.optim.Adam(probe.parameters(), lr=0.01)
    for _ in range(300):
        popt.zero_grad()
        F.cross_entropy(probe(z[g.train_mask]), g.y[g.train_mask]).backward()
        popt.step()
    return float((probe(z[g.test_mask]).argmax(-1) == g.y[g.test_mask]).float().mean())


TASKS = {"link_prediction_auc": link_prediction, "lightgcn_recall@20": recommendation,
         "gae_auc": autoencoder, "vgae_auc": lambda c, s, e: autoencoder(c, s, e, variational=True),
         "rgcn_accuracy": relational, "infomax_accuracy": infomax}


def _bytes_worker(rank, world, out_path):
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import GCNConv, LightGCN

    from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
    from pyg_pipe.graph import sbm_graph

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = GCNConv(64, 128), GCNConv(128, 64)

        def encode(self, x, edge_index):
            return self.conv2(self.conv1(x, edge_index).relu(), edge_index)

    g = sbm_graph(2708, num_classes=7, avg_degree=4, num_features=64, seed=0)
    results = {}
    for task in ("link_prediction", "lightgcn"):
        for mode, (stages, ways, chunks) in (("graph_parallel", (1, 2, 2)), ("gnnpipe 8 chunks", (2, 1, 8))):
            torch.manual_seed(0)
            model = Net() if task == "link_prediction" else LightGCN(g.num_nodes, 64, num_layers=3)
            engine = GNNPipeEngine(model, PipelineConfig(num_chunks=chunks), Comm(torch.device("cpu")),
                                   num_stages=stages, ways=ways)
            engine.install()
            for step in range(2):  # the first plans (and fills history): the second is counted
                engine.comm.reset_counters()
                if task == "link_prediction":
                    z = model.encode(g.x, g.edge_index)
                else:
                    z = model.get_embedding(g.edge_index)
                F.mse_loss(z, torch.zeros_like(z)).backward()
            results[f"{task} / {mode}"] = engine.comm.totals()
            engine.uninstall()
    if rank == 0:
        import json
        with open(out_path, "w") as fh:
            json.dump(results, fh, indent=1)


def measure_bytes(out: str) -> None:
    import tempfile

    from tests.dist import run_distributed
    path = out or tempfile.mktemp(suffix=".json")
    run_distributed(_bytes_worker, 2, path, timeout=1200)
    with open(path) as fh:
        results = json.load(fh)
    for name, totals in results.items():
        parts = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in totals.items() if v and k != "total")
        print(f"{name:36s} {totals['total'] / 2**20:8.2f} MiB per step ({parts})")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, nargs="+", default=[8])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--out", default=None)
    p.add_argument("--bytes", action="store_true", help="measure the bytes per step on 2 processes instead")
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    if args.bytes:
        measure_bytes(args.out)
        return
    results = {}
    for task in args.tasks:
        run = TASKS[task]
        for chunks in [None] + args.chunks:
            name = "one process" if chunks is None else f"{chunks} chunks"
            values = [run(chunks, s, args.epochs) for s in args.seeds]
            results[f"{task} / {name}"] = values
            print(f"{task:22s} {name:12s} mean {statistics.mean(values):.4f}  "
                  f"({', '.join(f'{v:.4f}' for v in values)})", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"epochs": args.epochs, "seeds": args.seeds, "tasks": args.tasks, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
