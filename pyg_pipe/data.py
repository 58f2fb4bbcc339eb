"""Lightning data module for full-graph training: every step, on every process, sees the whole graph."""

from __future__ import annotations

from typing import Callable, Optional, Union

import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler
from torch_geometric.data import Data

__all__ = ["FullGraphDataModule"]


def _identity(item):
    """Collate function that returns the single ``Data`` untouched (no ``Batch``, no copy)."""
    return item


class FullGraphDataModule(pl.LightningDataModule):
    """Serve one graph, whole and unchanged, as the only batch of every epoch and every stage.

    Full-graph training (GNNPipe, graph parallelism) does one optimizer step per epoch on the whole
    graph, and every process of the run needs that whole graph: the strategy, not the data loader,
    decides which vertices a process computes. The train / val / test / predict loaders therefore
    each yield the same ``Data`` object once per epoch: no collation into a ``Batch``, no shuffling,
    no worker processes. The graph is selected by its masks (``train_mask`` / ``val_mask`` /
    ``test_mask``) inside the ``LightningModule``'s steps.

    Works with several devices: each loader carries a single-replica ``DistributedSampler``, so
    Lightning does not replace it by one that would split the single item over the ranks (which
    would leave most ranks without a batch, and fails in ``predict``). Every process sees the whole
    graph. PyG's ``LightningNodeData(loader="full")``, by contrast, refuses more than one device.

    Pass a zero-argument callable instead of a ``Data`` to build or load the graph in
    :meth:`setup`, so that each process makes its own copy (generate it with a fixed seed so all
    processes agree) instead of receiving a pickled one from the launcher. With the ``spawn`` start
    method the callable itself is pickled: use a module-level function or ``functools.partial``,
    not a lambda.

    Example::

        from functools import partial

        import lightning.pytorch as pl
        import pyg_pipe  # registers strategy="gnnpipe"
        from pyg_pipe.data import FullGraphDataModule
        from pyg_pipe.graph import sbm_graph

        datamodule = FullGraphDataModule(partial(sbm_graph, 50_000, avg_degree=20, seed=0))
        trainer = pl.Trainer(strategy="gnnpipe", devices=4, max_epochs=200)
        trainer.fit(model, datamodule=datamodule)

    Args:
        data: the graph, or a zero-argument callable returning it (called once, in ``setup``).
    """

    def __init__(self, data: Union[Data, Callable[[], Data]]) -> None:
        super().__init__()
        if isinstance(data, Data):
            self._data: Optional[Data] = data
            self._make_data: Optional[Callable[[], Data]] = None
        elif callable(data):
            self._data = None
            self._make_data = data
        else:
            from torch_geometric.data import HeteroData
            if isinstance(data, HeteroData):
                raise TypeError(
                    "`data` is a HeteroData: heterogeneous graphs are not supported by pyg_pipe's strategies yet. "
                    "Convert the graph with data.to_homogeneous() (it keeps node_type and edge_type vectors) and "
                    "train a model with typed layers that take edge_type (RGCNConv, RGATConv; x=None "
                    "gives RGCNConv the vertex ids), which pyg_pipe runs exactly; or train the heterogeneous model "
                    "on one device.")
            raise TypeError(
                "`data` must be a torch_geometric.data.Data or a zero-argument callable returning one, "
                f"got {type(data).__name__}")

    @property
    def data(self) -> Data:
        """The graph; builds it first when a callable was given and :meth:`setup` has not run."""
        if self._data is None:
            self.setup()
        assert self._data is not None
        return self._data

    def setup(self, stage: Optional[str] = None) -> None:
        """Build the graph from the callable, once per process (later calls keep the first graph).

        Args:
            stage: the Lightning stage (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``); unused.
        """
        if self._data is None:
            assert self._make_data is not None
            data = self._make_data()
            if not isinstance(data, Data):
                raise TypeError(
                    "the callable passed as `data` must return a torch_geometric.data.Data, got "
                    f"{type(data).__name__}")
            self._data = data

    def _loader(self) -> DataLoader:
        items = [self.data]
        sampler = DistributedSampler(items, num_replicas=1, rank=0, shuffle=False)
        return DataLoader(items, batch_size=None, sampler=sampler, collate_fn=_identity, num_workers=0)

    def train_dataloader(self) -> DataLoader:
        """Loader yielding the whole graph once per epoch (one optimizer step per epoch)."""
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        """Loader yielding the whole graph once; select vertices with ``val_mask``."""
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        """Loader yielding the whole graph once; select vertices with ``test_mask``."""
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        """Loader yielding the whole graph once."""
        return self._loader()
