"""Heterogeneous graphs are not supported as ``HeteroData`` yet; the fix the refusal names is to convert the graph
with ``to_homogeneous()`` and use typed layers. That fix works: a two-type graph converted so, with an R-GCN
over its edge types, runs on 4 chunks exactly as on one device (inference, and the first training step)."""
import copy

import torch
from torch import nn
from torch_geometric.data import HeteroData
from torch_geometric.nn import RGCNConv

from tests.tasks.common import chunked_engine


class TypedNet(nn.Module):
    def __init__(self, relations):
        super().__init__()
        self.conv1 = RGCNConv(8, 16, relations)
        self.conv2 = RGCNConv(16, 3, relations)

    def forward(self, x, edge_index, edge_type):
        return self.conv2(self.conv1(x, edge_index, edge_type).relu(), edge_index, edge_type)


def hetero_graph():
    gen = torch.Generator().manual_seed(0)
    data = HeteroData()
    data["paper"].x = torch.randn(40, 8, generator=gen)
    data["author"].x = torch.randn(30, 8, generator=gen)
    data["author", "writes", "paper"].edge_index = torch.stack(
        [torch.randint(0, 30, (90,), generator=gen), torch.randint(0, 40, (90,), generator=gen)])
    data["paper", "cites", "paper"].edge_index = torch.stack(
        [torch.randint(0, 40, (80,), generator=gen), torch.randint(0, 40, (80,), generator=gen)])
    data["paper", "rev_writes", "author"].edge_index = data["author", "writes", "paper"].edge_index.flip(0)
    return data


def test_a_heterogeneous_graph_converted_to_homogeneous_runs_exactly_on_chunks():
    data = hetero_graph().to_homogeneous()
    relations = int(data.edge_type.max()) + 1
    torch.manual_seed(0)
    model = TypedNet(relations)
    plain = copy.deepcopy(model)
    engine = chunked_engine(model)
    engine.install()
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(data.x, data.edge_index, data.edge_type),
                                       plain(data.x, data.edge_index, data.edge_type), atol=1e-5, rtol=0)
        assert engine.plan.num_chunks == 4
        out = model(data.x, data.edge_index, data.edge_type)  # the first step reads history an exact pass filled
        torch.testing.assert_close(out, plain(data.x, data.edge_index, data.edge_type), atol=1e-5, rtol=0)
    finally:
        engine.uninstall()
