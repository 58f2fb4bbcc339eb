"""The runtime: everything a plan runs with, built at once from the plan; its state round-trips."""
import torch
from torch_geometric.nn import GCN

from pyg_pipe.engine import Comm, PipelineConfig
from pyg_pipe.engine.plan.grid import RankGrid
from pyg_pipe.engine.plan.plan import make_plan
from pyg_pipe.engine.plan.shape import decide_shape
from pyg_pipe.engine.runtime.runtime import Runtime
from pyg_pipe.model.inputs import CallInputs
from pyg_pipe.model.trace import forward_function
from tests.harness import ranges
from tests.zoo import zoo_graph


def _runtime(chunks: int, ways: int = 1, world: int = 1, rank: int = 0):
    x, g, _, _ = zoo_graph()
    model = GCN(8, 12, 2, 3)
    inputs = CallInputs((x, g["edge_index"]), {})
    config = PipelineConfig(num_chunks=chunks, partition=ranges)
    comm = Comm(torch.device("cpu"))
    shape = decide_shape(model, inputs, 1, 1, 1, 1, None)
    plan = make_plan(model, config, shape, inputs, comm, 0)
    grid = RankGrid(rank, world, 1, world)
    return Runtime(plan, grid, comm, config, model, forward_function(model), inputs), plan, g["edge_index"]


def test_the_chunkings_follow_the_plan():
    rt, plan, ei = _runtime(4)
    assert rt.graph.num_chunks == 4 and rt.way_chunked[0].num_chunks == 1
    assert rt.way_rows == [plan.num_nodes] and rt.way_bounds == [0, plan.num_nodes]
    assert [lg.rows for lg in rt.graph.chunks] == [16, 16, 16, 16]
    rt1, _, _ = _runtime(1)
    assert rt1.way_chunked is rt1.chunked           # one chunk per way: the same chunking serves both
    assert rt.schedule.num_chunks == 4 and rt.history.num_nodes == plan.num_nodes


def test_a_transposed_graph_is_chunked_once():
    rt, _, ei = _runtime(4)
    flipped = rt.derive(rt.graph, "flip")
    assert rt.derive(rt.graph, "flip") is flipped and flipped in rt.training_graphs()
    assert torch.equal(flipped.new_src, rt.graph.new_dst) and torch.equal(flipped.new_dst, rt.graph.new_src)


def test_the_state_round_trips():
    rt, _, _ = _runtime(4)
    rt.sites.record("train:0", ["conv#0.0:x:0"])
    rt.history.of(0).write("conv#0.0:x", 0, torch.ones(3, 2))
    rt.history.of(0).initialised = True
    state = rt.state_dict()
    other, _, _ = _runtime(4)
    other.load_state_dict(state)
    assert other.history.of(0).initialised
    assert torch.equal(other.history.of(0).buffers["conv#0.0:x"], rt.history.of(0).buffers["conv#0.0:x"])
    assert other.sites.saved == {"train:0": ["conv#0.0:x:0"]}
