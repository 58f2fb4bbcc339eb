"""Errors in a pipeline run: the rank that fails tells the others why before it exits."""
from __future__ import annotations

from typing import Any

from torch import Tensor


class PostsErrors:
    """Mixed into the strategies: every Lightning hook that runs the user's code (the steps, the backward)
    posts an exception to the other ranks (:meth:`pyg_pipe.engine.Comm.post_error`) before this rank exits,
    so a rank blocked on it raises the original error instead of a connection error. The spawn and fork
    launchers run the trainer without Lightning's exception hooks in the workers, hence the wrappers.
    ``_training_step`` is the strategy's own step, wrapped here."""

    comm: Any
    _failed: bool

    def _posting_errors(self, fn, *args, **kwargs):
        """Runs ``fn``; if it raises, every other rank learns why before this one exits."""
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            self._failed = True
            if self.comm is not None:
                self.comm.post_error(exc)
            raise

    def validation_step(self, *args: Any, **kwargs: Any):
        return self._posting_errors(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        return self._posting_errors(super().test_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        return self._posting_errors(super().predict_step, *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer, *args: Any, **kwargs: Any) -> Tensor:
        return self._posting_errors(super().backward, closure_loss, optimizer, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any):
        return self._posting_errors(self._training_step, *args, **kwargs)

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        if self.comm is not None:
            self.comm.post_error(exception)
        super().on_exception(exception)
