import sys, torch
from torch import nn
import torch_geometric.nn as gnn
import torch_geometric.nn.aggr as A
from torch_geometric.utils import dropout_edge, add_self_loops, remove_self_loops, to_undirected
from tests.zoo import zoo_graph
from tests.harness import check_mode
from tests.dist import run_distributed
H = 12

class Stack(nn.Module):
    def __init__(self, make, pre=None, call=None):
        super().__init__(); self.c1 = gnn.GCNConv(8, H); self.c2 = make(H); self.c3 = make(H); self.lin = nn.Linear(H, 3)
        self.pre = pre; self.call = call
    def forward(self, x, edge_index):
        x = self.c1(x, edge_index).relu()
        ei = self.pre(edge_index, x) if self.pre else edge_index
        call = self.call or (lambda conv, x, ei: conv(x, ei))
        x = call(self.c2, x, ei).relu()
        return self.lin(call(self.c3, x, ei))

def _att(conv, x, ei):
    out, (ei2, alpha) = conv(x, ei, return_attention_weights=True)
    return out

CASES = {
 "GCN-decomposed": lambda: Stack(lambda h: gnn.GCNConv(h, h, decomposed_layers=2)),
 "SAGE-decomposed": lambda: Stack(lambda h: gnn.SAGEConv(h, h, decomposed_layers=3)),
 "GAT-decomposed": lambda: Stack(lambda h: gnn.GATConv(h, h, decomposed_layers=2)),
 "dropout_edge-p0": lambda: Stack(lambda h: gnn.GCNConv(h, h), pre=lambda ei, x: dropout_edge(ei, p=0.0)[0]),
 "add_self_loops-forward": lambda: Stack(lambda h: gnn.GCNConv(h, h, add_self_loops=False), pre=lambda ei, x: add_self_loops(ei, num_nodes=x.size(0))[0]),
 "remove_self_loops-forward": lambda: Stack(lambda h: gnn.GCNConv(h, h), pre=lambda ei, x: remove_self_loops(ei)[0]),
 "to_undirected-forward": lambda: Stack(lambda h: gnn.SAGEConv(h, h), pre=lambda ei, x: to_undirected(ei, num_nodes=x.size(0))),
 "GAT-return-attention": lambda: Stack(lambda h: gnn.GATConv(h, h, heads=1), call=_att),
 "softmax-learn": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.SoftmaxAggregation(learn=True))),
 "powermean-learn": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.PowerMeanAggregation(learn=True))),
 "std": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr="std")),
 "median": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.MedianAggregation())),
 "quantile": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.QuantileAggregation(0.3))),
 "attentional": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.AttentionalAggregation(nn.Linear(h, 1)))),
 "multi-attn": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.MultiAggregation(["mean", "max"], mode="attn", mode_kwargs=dict(in_channels=h, out_channels=h, num_heads=2)))),
 "set2set": lambda: Stack(lambda h: gnn.GraphConv(h, h, aggr=A.Set2Set(h, processing_steps=2)) if False else gnn.SAGEConv(h, h, aggr=A.Set2Set(h, 2))),
 "setTransformer": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.SetTransformerAggregation(h, heads=2))),
 "mlp-aggr": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.MLPAggregation(h, h, max_num_elements=16, num_layers=1))),
 "sort-aggr": lambda: Stack(lambda h: gnn.SAGEConv(h * 2, h, aggr=A.SortAggregation(k=2))),
 "variance-preserving": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.VariancePreservingAggregation())),
 "equilibrium": lambda: Stack(lambda h: gnn.SAGEConv(h, h, aggr=A.EquilibriumAggregation(h, h, [4]))),
}

def worker(rank, world, mode, names):
    torch.set_default_dtype(torch.float64)
    x, g, y, mask = zoo_graph()
    ei = g["edge_index"]
    srt = ei[:, torch.argsort(ei[1] * x.size(0) + ei[0])]
    for name in names:
        try:
            got = check_mode(mode, CASES[name], dict(x=x, edge_index=srt), y, mask, world)
        except Exception as e:
            got = f"harness crash {type(e).__name__}: {e}"
        if rank == 0: print(f"RES {mode:22s} {name:28s} {got[:170]}", flush=True)

if __name__ == "__main__":
    names = sys.argv[2:] or list(CASES)
    mode = sys.argv[1]
    w = 1 if mode.startswith("streaming") else (4 if mode == "hybrid" else 2)
    run_distributed(worker, w, mode, names, timeout=900)
