"""The launchers of pyg_pipe's strategies: Lightning's own, with what pipelines need around them.

* Before any worker starts (in the launching process), the model is checked for refusals that its
  structure decides (pooling, more stages than layers), and the graph, when the arguments of ``fit`` /
  ``validate`` / ``test`` / ``predict`` hold it (a ``FullGraphDataModule`` or a loader over a list), for a
  malformed ``edge_index``: both surface once, in a few lines.
* The spawn / fork launcher also brings rank 0's pipeline state home with the results, so
  ``trainer.save_checkpoint`` after ``fit`` in the main process still holds the history.
"""
from __future__ import annotations

import atexit
import os
import tempfile
from typing import Any, Dict

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher


class CheckedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script (popen) launcher, checking the model before it starts the other processes."""

    def __init__(self, strategy, *args: Any) -> None:
        super().__init__(*args)
        self.strategy = strategy

    def launch(self, function, *args, trainer=None, **kwargs):
        self.strategy.check_before_launch(*args, **kwargs)
        atexit.register(_destroy_process_group)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ResultsLauncher(_MultiProcessingLauncher):
    """Lightning's spawn / fork launcher, checking the model first and returning the pipeline's state and
    counters of rank 0 to the main process."""

    def launch(self, function, *args, trainer=None, **kwargs):
        self._strategy.check_before_launch(*args, **kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _wrapping_function(self, *args, **kwargs) -> None:
        super()._wrapping_function(*args, **kwargs)
        _destroy_process_group()  # the worker ends here

    def get_extra_results(self, trainer) -> Dict[str, Any]:
        """The pipeline's state and counters go home in a file, as Lightning's weights do: through the results
        queue (a pipe), a payload larger than the pipe's buffer blocks the worker until the main process reads,
        and the main process reads only after every worker has ended (a spawned fit on a 6,000-vertex graph hung
        there)."""
        extra = super().get_extra_results(trainer)
        fd, path = tempfile.mkstemp(prefix="pyg_pipe-results-", suffix=".pt")
        with os.fdopen(fd, "wb") as f:
            torch.save(self._strategy.worker_results(), f)
        extra["pyg_pipe"] = path
        return extra

    def update_main_process_results(self, trainer, extra: Dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        path = extra.get("pyg_pipe")
        if path:
            try:
                self._strategy.take_worker_results(torch.load(path, weights_only=False))
            finally:
                os.remove(path)


def _destroy_process_group() -> None:
    """Takes the process group down in order rather than leave gloo's threads to the interpreter's exit, where
    a process that had finished its work aborted ("terminate called without an active exception": seen after a
    spawned fit in CI, and under torchrun after fit and test)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
