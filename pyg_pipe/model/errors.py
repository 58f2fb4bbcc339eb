"""The error every refusal raises: what cannot run, why, and what to change."""


class UnsupportedModelError(ValueError):
    """The model cannot be run (exactly) by pyg_pipe as configured; the message says why and what to do."""
