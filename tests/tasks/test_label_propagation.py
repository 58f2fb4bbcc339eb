"""PyG's parameter-free propagation as the model (examples/label_prop.py, correct_and_smooth.py), at inference on 2
processes: ``LabelPropagation`` on one-hot labels equals one process in ``graph_parallel`` and in ``gnnpipe`` (its one
layer runs on 2 graph-parallel ways there); on integer labels (the class count inferred from their largest value, a
reduction over every vertex) it is refused naming ``max``; ``CorrectAndSmooth.correct``, whose ``y_true`` holds the
training vertices' labels alone, is refused naming the method, the assertion it failed and what is cut."""
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import CorrectAndSmooth, LabelPropagation

from pyg_pipe import UnsupportedModelError
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from tests.dist import run_distributed
from tests.models import small_graph


def _engine(model, stages, ways):
    engine = GNNPipeEngine(model, PipelineConfig(num_chunks=ways), Comm(torch.device("cpu"), timeout=60),
                           num_stages=stages, ways=ways)
    engine.install()
    return engine


def _worker(rank, world):
    x, edge_index, y, mask = small_graph()
    labels = F.one_hot(y, 3).float()
    for stages, ways in ((1, 2), (None, None)):  # graph_parallel; gnnpipe's default grid (1 x 2 for one layer)
        for given in (labels, y):
            model = LabelPropagation(num_layers=3, alpha=0.9)
            ref = model(given, edge_index, mask=mask)
            engine = _engine(model, stages, ways)
            try:
                if given is labels:
                    torch.testing.assert_close(model(given, edge_index, mask=mask), ref, atol=1e-6, rtol=0)
                else:
                    with pytest.raises(UnsupportedModelError, match=r"LabelPropagation.forward calls `max`, which reduces "
                                                                    r"over the rows of different vertices"):
                        model(given, edge_index, mask=mask)
            finally:
                engine.uninstall()
    post = CorrectAndSmooth(num_correction_layers=3, correction_alpha=1.0, num_smoothing_layers=3,
                            smoothing_alpha=0.8, autoscale=False, scale=20.0)
    engine = _engine(post, 1, 2)
    try:
        with pytest.raises(UnsupportedModelError, match=r"CorrectAndSmooth.correct raised AssertionError on its first "
                                                        r"pass over part of the graph.*y\[train_mask\]"):
            post.correct(labels.softmax(-1), y[mask], mask, edge_index)
    finally:
        engine.uninstall()


def test_label_propagation_exact_or_refused():
    run_distributed(_worker, 2, timeout=300)


def _same_engine_worker(rank, world):
    x, edge_index, y, mask = small_graph()
    model = LabelPropagation(num_layers=3, alpha=0.9)
    engine = _engine(model, 1, 2)
    try:
        model(F.one_hot(y, 3).float(), edge_index, mask=mask)  # checked, exact
        # the same mode, another kind of call (integer labels take another path through the forward): checked too
        with pytest.raises(UnsupportedModelError, match=r"LabelPropagation.forward calls `max`"):
            model(y, edge_index, mask=mask)
    finally:
        engine.uninstall()


def test_another_kind_of_call_is_checked_on_its_first_pass():
    run_distributed(_same_engine_worker, 2, timeout=300)
