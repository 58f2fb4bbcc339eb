"""The error every refusal raises: what cannot run, why, and what to change."""


class UnsupportedModelError(ValueError):
    """The model cannot be run (exactly) by pyg_pipe as configured; the message says why and what to do."""


class NoLayerCalled(UnsupportedModelError):
    """The forward, traced, calls no message-passing layer (PyG's ``PMLP`` in training: its graph layers run in
    eval only): nothing to cut into stages, but its rows can still be split among graph-parallel ways."""


class CannotTrace(UnsupportedModelError):
    """torch.fx cannot trace the distributed method into units (Python control flow on tensor values, item
    assignment): it cannot be cut into pipeline stages, but graph-parallel ways run it as it is. ``method``: its
    name (``Model.forward``); ``reason``: fx's error."""

    def __init__(self, message: str, method: str = "", reason: str = ""):
        super().__init__(message)
        self.method, self.reason = method, reason
