"""FullGraphDataModule hands the same whole graph to every loader, every epoch, every process."""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DistributedSampler

from pyg_pipe.data import FullGraphDataModule
from pyg_pipe.graph import karate_club


def _loaders(dm):
    return [dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()]


def test_every_loader_yields_the_same_data_object():
    data = karate_club()
    dm = FullGraphDataModule(data)
    dm.setup("fit")
    for loader in _loaders(dm):
        for _ in range(2):  # two epochs
            items = list(loader)
            assert len(items) == 1 and items[0] is data
        assert loader.num_workers == 0
        # single-replica DistributedSampler: Lightning keeps it, so every rank gets the graph
        assert isinstance(loader.sampler, DistributedSampler) and list(loader.sampler) == [0]


def test_callable_is_called_once_in_setup():
    calls = []

    def make():
        calls.append(1)
        return karate_club()

    dm = FullGraphDataModule(make)
    assert calls == []
    dm.setup("fit")
    dm.setup("test")
    assert len(calls) == 1
    assert next(iter(dm.train_dataloader())) is dm.data


def test_bad_data():
    with pytest.raises(TypeError, match="data"):
        FullGraphDataModule(42)
    dm = FullGraphDataModule(lambda: 42)
    with pytest.raises(TypeError, match="data"):
        dm.setup()


class _Probe(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(34, 4)
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch)
        out = self.lin(batch.x)
        return torch.nn.functional.cross_entropy(out[batch.train_mask], batch.y[batch.train_mask])

    def validation_step(self, batch, batch_idx):
        self.seen.append(batch)

    def test_step(self, batch, batch_idx):
        self.seen.append(batch)

    def predict_step(self, batch, batch_idx):
        self.seen.append(batch)
        return self.lin(batch.x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.filterwarnings("ignore")
def test_trainer_runs_one_step_per_epoch():
    data = karate_club()
    dm = FullGraphDataModule(data)
    model = _Probe()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2
    trainer.test(model, datamodule=dm, verbose=False)
    preds = trainer.predict(model, datamodule=dm)
    assert len(preds) == 1 and preds[0].shape == (34, 4)
    assert len(model.seen) == 2 + 2 + 1 + 1  # train+val per epoch, test, predict
    assert all(b is data for b in model.seen)
