"""The model shapes people write (:mod:`tests.shapes`: JumpingKnowledge, ResGCN+ with and without
checkpointing, reversible blocks, an LSTM state, ``forward(data)``, control flow, graph-wide norms, an
edge encoder, a transposed graph, zero-initialised layers, K-hop layers, attention over all vertices
(GPSConv, SGFormer), Graph U-Net, LSTM and GRU aggregations, PMLP, Polynormer; and :mod:`tests.shapes_pyg`: EdgeCNN,
GATv2, PNA, RECT_L, LINKX, MaskLabel, DirGNNConv, a layer as the whole model, per-vertex buffers and parameters,
degrees, gcn_norm and edge features computed in forward) in every mode, against one process. float64; one process
launch per mode. Streaming (one device, 4 chunks, layer group by layer group) is exact at any learning rate, like
graph parallelism; a forward that does not trace streams as one group.

Exact where the algorithm is (graph parallel, one chunk per way); at several chunks, the training
forward at lr = 0 equals one process; what cannot run is refused with a message naming the module
and the fix.
"""
import json

import pytest
import torch

from tests import harness
from tests.dist import run_distributed
from tests.shapes import SHAPES, graph
from tests.shapes_pyg import MORE

UNSPLITTABLE = ["cannot split ControlFlow", "submodule", "graph_parallel"]
POOLING = ["'pools.0' (TopKPooling)", "builds a new graph"]
HYPER = ["'conv1' (HypergraphConv) takes hyperedges", "one device"]
STATS = ["normalises with statistics over all vertices", "per_chunk_statistics=True"]
TOO_SHALLOW = ["1 message-passing layers but the pipeline has 2 stages", "gnnpipe_hybrid"]
ATTENTION = ["'gps.attn' (MultiheadAttention)", "multiplies the rows of different vertices", "num_chunks=1"]

EDGE_IDS = ["'conv1' (FastRGCNConv) is given integer vertex features", "RGCNConv instead of FastRGCNConv"]
NO_LAYER = ["PMLP calls no MessagePassing layer in its forward in training mode", "strategy='graph_parallel'"]
GLOBAL = ["'trans_conv' (SGModule) calls `sort`", "num_chunks=1"]
DEGREE = ["calls `scatter_add_`", "sums over the graph's edges per vertex", "outside the MessagePassing layers",
          "data.deg = degree("]
ENDPOINTS = ["calls `__getitem__`", "at the ends of the graph's edges", "outside the MessagePassing layers"]
# a weight whose first dimension equals the vertex count by coincidence is taken for per-vertex values (by its size,
# never its values): cut, the matmul that contracts it is refused, never run on part of its rows
WIDE = ["calls `matmul`", "multiplies the rows of different vertices"]
# a per-vertex buffer the forward writes in place: a chunk sees a copy of its rows (refused where the graph is cut); a
# traced pipeline refuses buffers changed in the forward
WRITTEN = ["WritesPerVertexState.memory has one row per vertex", "changed it in place"]
# a per-vertex tensor a layer holds itself: refused where the graph is cut, naming the fix (hold it in the model)
IN_LAYER = ["Layer 'c1' (_EncodedConv) holds 'pe', a tensor with one row per vertex", "Hold it in the model instead"]
BUILT = ["calls `sparse_coo_tensor`", "builds a graph (a sparse tensor) from the graph's edges", "data pipeline"]
#: a two-hop graph from PyG's to_torch_coo_tensor, a product with its to_torch_csr_tensor: their coalesce numbers edges
#: by x.size(0) first; fx cannot trace them
SIZE = ["calls `mul_`", "uses a number read from a size"]
TWO_HOP = {"size": SIZE, "trace": ["cannot split TwoHopInForward", "to_torch_coo_tensor"],
           "graph": ["Layer 'c1' (SAGEConv) receives a graph computed inside forward"]}
CSR_TRACE = ["cannot split CSRInForward", "to_torch_csr_tensor"]
# refused wherever the graph is cut
CUT = {"sparse-adjacency-in-forward": BUILT,
       "degree-in-forward": DEGREE, "gcn_norm-in-forward": DEGREE, "edge-features-in-forward": ENDPOINTS,
       "graph-wide-weight": WIDE, "per-vertex-state-written": WRITTEN, "per-vertex-in-a-layer": IN_LAYER}
SHALLOW = {"RECT_L": TOO_SHALLOW, "LINKX": TOO_SHALLOW, "SGConv-as-the-model": TOO_SHALLOW,
           "GATConv-as-the-model": TOO_SHALLOW}

# mode -> case -> words of the expected refusal (every other case must be exact). BatchNorm, GraphNorm and PyG's
# graph-mode LayerNorm with several chunks per way in the pipeline take historical statistics by default
# (per_chunk_statistics="auto"): exact at lr = 0; streaming still refuses them
REFUSED = {
    "graph_parallel": {"GraphUNet": POOLING, "HypergraphConv": HYPER, "GPSConv": ATTENTION, "FastRGCN-featureless": EDGE_IDS,
                       "SGFormer": GLOBAL, "two-hop-in-forward": TWO_HOP["size"],
                       "csr-in-forward": SIZE, **CUT},
    "pipeline": {"GraphUNet": POOLING, "HypergraphConv": HYPER, "control-flow": UNSPLITTABLE, "APPNP-one-layer": TOO_SHALLOW,
                 "PMLP": NO_LAYER, "per-vertex-state-written": ["changes the values of its buffer `memory`"],
                 "two-hop-in-forward": TWO_HOP["trace"], "csr-in-forward": CSR_TRACE, **SHALLOW},
    "chunks": {"GraphUNet": POOLING, "HypergraphConv": HYPER, "control-flow": UNSPLITTABLE, "APPNP-one-layer": TOO_SHALLOW,
               "FastRGCN-featureless": EDGE_IDS, "GPSConv": ATTENTION, "PMLP": NO_LAYER,
               "SGFormer": GLOBAL, "two-hop-in-forward": TWO_HOP["trace"], "csr-in-forward": CSR_TRACE, **SHALLOW,
               **CUT},
    "graph_parallel_chunks": {"GraphUNet": POOLING, "HypergraphConv": HYPER, "FastRGCN-featureless": EDGE_IDS,
                              "GPSConv": ATTENTION, "SGFormer": GLOBAL, "two-hop-in-forward": TWO_HOP["size"],
                              "csr-in-forward": SIZE, **CUT},
    "streaming": {"GraphUNet": POOLING, "HypergraphConv": HYPER, "GCN-batchnorm": STATS, "GCN-graphnorm": STATS,
                  "FastRGCN-featureless": EDGE_IDS,
                  "GCN-pyg-layernorm-graph": STATS, "GPSConv": ATTENTION, "PMLP": STATS,
                  "Polynormer-local": STATS, "SGFormer": STATS, "LINKX": STATS, "two-hop-in-forward": TWO_HOP["graph"],
                  "csr-in-forward": SIZE, **CUT},
}


def _sweep(rank, world, mode, path):
    torch.set_default_dtype(torch.float64)
    g = graph()
    _, _, y, mask = g
    results = {name: harness.check_mode(mode, make, inputs(g), y, mask, world)
               for name, (make, inputs) in {**SHAPES, **MORE}.items()}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize("mode", ["graph_parallel", "pipeline", "chunks", "graph_parallel_chunks", "streaming"])
def test_every_model_shape_is_exact_or_refused(mode, tmp_path):
    path = tmp_path / "shapes.json"
    run_distributed(_sweep, harness.MODES[mode], mode, str(path), timeout=600)
    results = json.loads(path.read_text())
    wrong = {}
    for name, outcome in results.items():
        words = REFUSED[mode].get(name)
        if words is None and outcome != "exact":
            wrong[name] = outcome
        elif words is not None and not (outcome.startswith("refused") and all(w in outcome for w in words)):
            wrong[name] = f"expected a refusal naming {words}, got: {outcome}"
    assert not wrong, json.dumps(wrong, indent=1)
