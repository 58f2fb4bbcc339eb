"""The model side: a call's inputs cut to chunks, tracing a model into units, cutting it into stages."""
from .errors import UnsupportedModelError
from .inputs import CallInputs, is_graph_tensor
from .localize import Localizer
from .split import Stage, balance, layer_groups, parameter_stages, split, stage_groups
from .trace import Program, SplitPoint, pipe_split, trace

__all__ = ["UnsupportedModelError", "CallInputs", "Localizer", "is_graph_tensor", "Stage", "balance", "layer_groups",
           "parameter_stages", "split", "stage_groups", "Program", "SplitPoint", "pipe_split", "trace"]
