"""A user's script: ``strategy="gnnpipe"`` by name. Run directly (Lightning's popen launcher starts the
other ranks) or under torchrun (Lightning's TorchElastic cluster environment)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import pyg_pipe  # noqa: E402,F401  (registers strategy="gnnpipe")
from pyg_pipe.engine import gnnpipe_bytes  # noqa: E402
from tests.lit import NodeClassifier  # noqa: E402
from tests.models import as_data, make_model, small_graph  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    data = as_data(*small_graph())
    trainer = pl.Trainer(strategy="gnnpipe", accelerator="cpu", devices=int(os.environ.get("DEVICES", "2")),
                         max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    lit = NodeClassifier(make_model("gcn"))
    trainer.fit(lit, datamodule=pyg_pipe.FullGraphDataModule(data))
    want = gnnpipe_bytes(data.num_nodes, trainer.world_size, width=16, out_width=3)["total"]
    got = int(trainer.callback_metrics["comm/bytes"])
    print(f"rank {trainer.global_rank} of {trainer.world_size}: env={type(trainer.strategy.cluster_environment).__name__} "
          f"comm={got} formula={want} OK={got == want}", flush=True)
