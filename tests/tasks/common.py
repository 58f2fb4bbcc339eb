"""What the task tests share: a model trained by hand on one process, and the same model trained through a real
Trainer on 2 processes under a pyg_pipe strategy in an exact mode, whose parameters must then be equal."""
import copy

import lightning.pytorch as pl
import torch

from pyg_pipe import GNNPipeStrategy, GraphParallelStrategy
from pyg_pipe.engine import Comm, GNNPipeEngine, PipelineConfig
from tests.harness import ranges
from tests.lit import graph_loader
from tests.models import as_data, small_graph

EPOCHS = 3


def graph_with_negatives():
    """The small test graph as a ``Data`` with ``neg_edge_index``: as many random vertex pairs as edges, drawn once
    (the auto-encoders' reconstruction loss reads them; fixed, so every rank and the reference use the same)."""
    data = as_data(*small_graph())
    gen = torch.Generator().manual_seed(1)
    data.neg_edge_index = torch.randint(0, data.num_nodes, (2, data.edge_index.size(1)), generator=gen)
    return data


def trained_on_one_process(model, loss_of, data, lr: float):
    """A copy of ``model`` after ``EPOCHS`` SGD + momentum steps on ``loss_of(model, data, epoch)``."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for epoch in range(EPOCHS):
        loss = loss_of(ref, data, epoch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return ref


def fit_exact(lit: pl.LightningModule, strategy: str, data, root) -> None:
    """``lit`` through a Trainer on 2 CPU processes: ``graph_parallel``, or ``gnnpipe`` with one chunk through its
    2 stages (both exact), for ``EPOCHS`` epochs of the one-graph loader."""
    make = GraphParallelStrategy if strategy == "graph_parallel" else GNNPipeStrategy
    kw = {} if strategy == "graph_parallel" else dict(num_chunks=1)
    pl.Trainer(strategy=make(start_method="spawn", comm_timeout=60, **kw), accelerator="cpu", devices=2,
               max_epochs=EPOCHS, default_root_dir=str(root), logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(lit, train_dataloaders=graph_loader(data))


def assert_same_parameters(model, ref, atol: float = 1e-5) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=0, msg=name)


def chunked_engine(model, chunks: int = 4, streaming: bool = False) -> GNNPipeEngine:
    """The engine on ``model`` in this process: one stage, ``chunks`` chunks of consecutive vertices
    (not installed)."""
    return GNNPipeEngine(model, PipelineConfig(num_chunks=chunks, partition=ranges, streaming=streaming),
                         Comm(torch.device("cpu")), num_stages=1)
