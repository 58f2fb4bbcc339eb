"""The model side: tracing an unchanged PyG model into steps and cutting it into pipeline stages."""
from .program import CONST, EDGE, GRAPH, NODE, Program, UnsupportedModelError, bind_inputs, trace
from .split import Stage, balance, layer_groups, parameter_owner, split

__all__ = ["Program", "UnsupportedModelError", "bind_inputs", "trace", "Stage", "balance", "layer_groups",
           "parameter_owner", "split", "NODE", "EDGE", "GRAPH", "CONST"]
