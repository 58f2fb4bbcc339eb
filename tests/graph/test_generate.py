"""Generated graphs are simple, undirected, reproducible, near their targets, and learnable."""

import pytest
import torch

from pyg_pipe.graph import karate_club, load_dataset, powerlaw_graph, sbm_graph


def _check_graph(data, num_nodes, num_features):
    ei = data.edge_index
    assert data.num_nodes == num_nodes
    assert data.x.dtype == torch.float32 and data.x.shape == (num_nodes, num_features)
    assert ei.dtype == torch.long and ei.dim() == 2 and ei.size(0) == 2
    assert data.y.dtype == torch.long and data.y.shape == (num_nodes,)
    assert bool((ei[0] != ei[1]).all())                                     # no self loops
    key = ei[0] * num_nodes + ei[1]
    assert torch.unique(key).numel() == key.numel()                          # no duplicates
    rev = ei[1] * num_nodes + ei[0]
    assert torch.equal(torch.sort(key).values, torch.sort(rev).values)        # undirected
    masks = [data.train_mask, data.val_mask, data.test_mask]
    assert all(m.dtype == torch.bool and m.shape == (num_nodes,) for m in masks)
    assert int(sum(m.long() for m in masks).max()) == 1                      # disjoint and covering


def _homophily(data):
    ei = data.edge_index
    return (data.y[ei[0]] == data.y[ei[1]]).float().mean().item()


def test_sbm_properties():
    data = sbm_graph(3000, num_classes=6, avg_degree=8.0, homophily=0.75, num_features=16, seed=2)
    _check_graph(data, 3000, 16)
    assert abs(data.edge_index.size(1) - 3000 * 8) <= 0.02 * 3000 * 8
    assert abs(_homophily(data) - 0.75) < 0.02
    assert torch.bincount(data.y).tolist() == [500] * 6
    assert data.train_mask.sum() == 1800 and data.val_mask.sum() == 600


def test_powerlaw_properties():
    data = powerlaw_graph(4000, avg_degree=10.0, exponent=2.5, homophily=0.6, seed=3)
    _check_graph(data, 4000, 32)
    assert abs(data.edge_index.size(1) - 40000) <= 0.05 * 40000
    assert abs(_homophily(data) - 0.6) < 0.03
    degree = torch.bincount(data.edge_index[0], minlength=4000)
    assert degree.max() > 8 * degree.float().mean()                            # heavy tail


@pytest.mark.parametrize("make", [sbm_graph, powerlaw_graph])
def test_deterministic(make):
    a, b, c = make(500, seed=4), make(500, seed=4), make(500, seed=5)
    for key in ("x", "edge_index", "y", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(a[key], b[key])
    assert not torch.equal(a.y, c.y)


def test_custom_split_and_dense_small_graph():
    data = sbm_graph(30, num_classes=3, avg_degree=40.0, seed=0, train_ratio=0.5, val_ratio=0.1)
    _check_graph(data, 30, 32)
    assert data.edge_index.size(1) <= 30 * 29                                  # capped at complete
    assert data.train_mask.sum() == 15 and data.val_mask.sum() == 3
    with pytest.raises(ValueError, match="train_ratio"):
        sbm_graph(30, train_ratio=0.9, val_ratio=0.2)
    with pytest.raises(ValueError, match="homophily"):
        sbm_graph(30, homophily=1.5)


def test_features_need_the_graph():
    # nearest class mean on raw features vs on neighbour-averaged features (what a GNN layer does)
    data = sbm_graph(2000, seed=0)
    n = data.num_nodes
    src, dst = data.edge_index
    degree = torch.bincount(dst, minlength=n)
    agg = data.x.clone().index_add_(0, dst, data.x[src]) / (degree + 1)[:, None]

    def accuracy(x):
        train = data.train_mask
        means = torch.stack([x[train & (data.y == c)].mean(0) for c in range(int(data.y.max()) + 1)])
        pred = torch.cdist(x, means).argmin(1)
        return (pred == data.y)[data.test_mask].float().mean().item()

    raw, smoothed = accuracy(data.x), accuracy(agg)
    assert 0.2 < raw < 0.75
    assert smoothed > raw + 0.2


def test_karate_club():
    data = karate_club()
    _check_graph(data, 34, 34)
    assert data.train_mask.sum() == 4 and data.val_mask.sum() == 15 and data.test_mask.sum() == 15


def test_load_dataset_offline():
    data = load_dataset("SBM", num_nodes=300, seed=1)
    assert torch.equal(data.edge_index, sbm_graph(300, seed=1).edge_index)
    assert load_dataset("powerlaw", num_nodes=300).num_nodes == 300
    assert load_dataset("karate").num_nodes == 34
    with pytest.raises(ValueError, match="name"):
        load_dataset("not-a-dataset")


def test_load_ogb_without_package():
    try:
        import ogb  # noqa: F401
        pytest.skip("ogb is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install ogb"):
        load_dataset("ogbn-arxiv")
