"""The plan: decided once from structure and knobs, immutable, saved and checked on resume.

One process (the collectives of planning are trivial there); the multi-process decisions (partition on
one rank, broadcast) are exercised by every distributed test.
"""
import dataclasses

import pytest
import torch
from torch import nn
from torch_geometric.nn import GCN, GCNConv, TopKPooling

from pyg_pipe import UnsupportedModelError
from pyg_pipe.engine import Comm, PipelineConfig
from pyg_pipe.engine.plan.norms import refuse_statistics, resolve_statistics
from pyg_pipe.engine.plan.plan import chunk_count, check_resume, graph_digest, make_plan
from pyg_pipe.engine.plan.shape import decide_shape, refuse_graph_builders
from pyg_pipe.model.inputs import CallInputs
from tests.harness import ranges
from tests.zoo import zoo_graph


def _inputs():
    x, g, _, _ = zoo_graph()
    return CallInputs((x, g["edge_index"]), {})


def _plan(model, stages=1, ways=1, **cfg):
    inputs = _inputs()
    config = PipelineConfig(**cfg)
    shape = decide_shape(model, inputs, stages * ways, stages, ways, 1, None)
    return make_plan(model, config, shape, inputs, Comm(torch.device("cpu")), 0), inputs, config, shape


def test_a_plan_is_immutable():
    plan, *_ = _plan(GCN(8, 12, 2, 3), num_chunks=4, partition=ranges)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_chunks = 8


def test_chunking_is_a_permutation_with_bounds():
    plan, inputs, *_ = _plan(GCN(8, 12, 2, 3), num_chunks=4, partition="greedy")
    N = inputs.num_nodes
    assert torch.equal(torch.sort(plan.perm).values, torch.arange(N))
    assert plan.ptr.tolist()[0] == 0 and plan.ptr.tolist()[-1] == N and plan.ptr.numel() == 5
    assert bool((plan.ptr[1:] > plan.ptr[:-1]).all())
    assert plan.chunks_per_way == 4 and plan.sizes is None  # one stage: nothing traced
    assert set(plan.param_stages) == {n for n, _ in GCN(8, 12, 2, 3).named_parameters()}


def test_default_chunk_counts():
    cfg = PipelineConfig(num_chunks=None)  # (the fixed rule; the default "auto": tests/engine/test_chunk_cost.py)
    assert chunk_count(cfg, 1, 4, 100) == 4            # graph parallel: one chunk per way
    assert chunk_count(cfg, 2, 1, 100) == 8            # 4 per stage
    assert chunk_count(cfg, 2, 2, 100) == 16           # 4 per stage for each way
    assert chunk_count(cfg, 8, 1, 20) == 20            # at most |V|
    assert chunk_count(cfg, 2, 3, 20) == 18            # ... and a multiple of the ways


def test_configured_chunk_counts():
    with pytest.raises(ValueError, match=r"num_chunks=61 is larger than the number of vertices \(60\)"):
        chunk_count(PipelineConfig(num_chunks=61), 2, 1, 60)
    with pytest.raises(ValueError, match="num_chunks=3 must be a multiple of the 2 graph-parallel ways"):
        chunk_count(PipelineConfig(num_chunks=3), 1, 2, 60)
    with pytest.raises(ValueError, match="3 graph-parallel ways need at least 3 vertices"):
        chunk_count(PipelineConfig(), 1, 3, 2)
    notes = []
    assert chunk_count(PipelineConfig(num_chunks=3), 1, 2, 60, ways_added=True, notes=notes) == 4
    assert chunk_count(PipelineConfig(num_chunks=1), 1, 2, 60, ways_added=True, notes=notes) == 2
    assert len(notes) == 2 and "using num_chunks=4" in notes[0]


class Deep(nn.Module):
    def __init__(self, layers=4):
        super().__init__()
        self.convs = nn.ModuleList(GCNConv(8 if i == 0 else 12, 12) for i in range(layers))

    def forward(self, x, edge_index):
        for conv in self.convs:
            x = conv(x, edge_index).relu()
        return x


def test_the_grid_follows_the_model():
    inputs = _inputs()
    shape = decide_shape(Deep(4), inputs, 2, None, None, 1, None)
    assert (shape.stages, shape.ways, shape.ways_added, len(shape.groups)) == (2, 1, False, 4)
    shape = decide_shape(Deep(1), inputs, 4, None, None, 1, None)  # one layer, 4 devices: ways added
    assert (shape.stages, shape.ways, shape.ways_added) == (1, 4, True) and "graph-parallel ways" in shape.notes[0]
    with pytest.raises(UnsupportedModelError, match="1 message-passing layers but the pipeline has 2 stages"):
        decide_shape(Deep(1), inputs, 2, 2, 1, 1, None)


def test_the_stage_split_owns_every_parameter_once():
    plan, *_ = _plan(Deep(4), stages=1, num_chunks=1)
    assert set(plan.owners.values()) == {0}
    inputs = _inputs()
    shape = decide_shape(Deep(4), inputs, 2, 2, 1, 1, None)
    model = Deep(4)
    plan = make_plan(model, PipelineConfig(balance=[1, 3]), shape, inputs, Comm(torch.device("cpu")), 0)
    assert plan.sizes == (1, 3)
    assert plan.owners["convs.0.lin.weight"] == 0 and plan.owners["convs.3.lin.weight"] == 1
    with pytest.raises(ValueError, match=r"balance=\[2, 3\] must give 2 positive layer counts summing to 4"):
        make_plan(model, PipelineConfig(balance=[2, 3]), shape, inputs, Comm(torch.device("cpu")), 0)


def test_a_saved_plan_is_reused_and_checked():
    plan, inputs, config, shape = _plan(GCN(8, 12, 2, 3), num_chunks=4, partition="random", seed=3)
    again = make_plan(GCN(8, 12, 2, 3), PipelineConfig(num_chunks=4, partition="random", seed=4), shape, inputs,
                      Comm(torch.device("cpu")), 0, saved=plan.state())
    assert torch.equal(again.perm, plan.perm) and torch.equal(again.ptr, plan.ptr)  # not partitioned again
    with pytest.raises(ValueError, match="saved with num_chunks = 4, but this run has 8"):
        check_resume(plan.state(), 1, 1, 8, inputs)
    x, g, _, _ = zoo_graph(seed=1)
    other = CallInputs((x, g["edge_index"]), {})
    with pytest.raises(ValueError, match="edge count|other edges"):
        check_resume(plan.state(), 1, 1, 4, other)


def test_a_plan_matches_graphs_by_structure():
    plan, inputs, *_ = _plan(GCN(8, 12, 2, 3), num_chunks=2, partition=ranges)
    x, ei = inputs.args
    assert plan.matches(CallInputs((x * 2, ei.clone()), {}))  # another object, same edges
    assert not plan.matches(CallInputs((x, ei[:, 1:]), {}))
    assert plan.matches(CallInputs((x, ei), {}))
    ei[0] = ei[0].roll(7)  # the same tensor, other edges: another graph (the stale plan ran off by 0.47 until 11-28)
    assert not plan.matches(CallInputs((x, ei), {}))
    assert graph_digest(ei) == graph_digest(ei.clone()) != graph_digest(ei.flip(0))


def test_structural_refusals():
    class Pooling(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.pool = GCNConv(8, 8), TopKPooling(8)

    with pytest.raises(UnsupportedModelError, match=r"'pool' \(TopKPooling\) builds a new graph"):
        refuse_graph_builders(Pooling())
    with pytest.raises(UnsupportedModelError, match=r"'norms.0.module' \(BatchNorm1d\).*num_chunks=2.*"
                                                    r"per_chunk_statistics"):
        refuse_statistics(GCN(8, 12, 2, 3, norm="batch_norm"), 4, 2)
    with pytest.raises(UnsupportedModelError, match=r"'norms.0' \(LayerNorm\)"):  # PyG's default mode: the graph
        refuse_statistics(GCN(8, 12, 2, 3, norm="layer_norm"), 4, 2)
    refuse_statistics(GCN(8, 12, 2, 3, norm="layer_norm", norm_kwargs={"mode": "node"}), 4, 2)  # per vertex: fine


def test_graph_wide_statistics_by_default():
    """per_chunk_statistics='auto': BatchNorm, GraphNorm, InstanceNorm, graph-mode LayerNorm take historical statistics
    with several chunks per way in the pipeline; one chunk per way needs nothing; streaming, or another graph-wide
    norm (torch's InstanceNorm1d), is as False."""
    notes = []
    assert resolve_statistics("auto", GCN(8, 12, 2, 3, norm="batch_norm"), 4, False, notes) == "history"
    assert len(notes) == 1 and "graph-wide norms ('norms.0.module') with 4 chunks per way" in notes[0]
    assert resolve_statistics("auto", GCN(8, 12, 2, 3, norm="graph_norm"), 4, False) == "history"
    assert resolve_statistics("auto", GCN(8, 12, 2, 3, norm="batch_norm"), 1, False) is False
    assert resolve_statistics("auto", GCN(8, 12, 2, 3, norm="batch_norm"), 4, True) is False
    assert resolve_statistics("auto", GCN(8, 12, 2, 3, norm="layer_norm"), 4, False) == "history"  # graph mode
    assert resolve_statistics("auto", GCN(8, 12, 2, 3, norm="instance_norm"), 4, False) == "history"
    assert resolve_statistics("auto", GCN(8, 12, 2, 3, norm="diffgroup_norm", norm_kwargs={"groups": 2}), 4,
                              False) == "history"  # (per row around a BatchNorm)
    assert resolve_statistics("auto", torch.nn.Sequential(GCN(8, 12, 2, 3), torch.nn.InstanceNorm1d(3)), 4,
                              False) is False
    from torch_geometric.nn import GIN  # a BatchNorm in each GINConv's MLP: inside a layer, on vertex rows (one in a
    assert resolve_statistics("auto", GIN(8, 12, 2, 3, norm="batch_norm"), 4, False) == "history"  # message: refused
    #                                                                     when it runs, tests/engine/test_statistics.py)
    for explicit in (True, False, "history"):
        assert resolve_statistics(explicit, GCN(8, 12, 2, 3, norm="batch_norm"), 4, False) == explicit
