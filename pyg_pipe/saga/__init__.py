"""SAGA-NN (NGra): layers as Scatter -> ApplyEdge -> Gather -> ApplyVertex, compiled to PyG ``MessagePassing``.

See :mod:`pyg_pipe.saga.layer` for the base class and the Gather routes, :mod:`pyg_pipe.ops.rewrite`
for the dataflow rewrite, and docs/saga.md.
"""
from ..ops.rewrite import SAGAProgram, compile_apply_edge
from .layer import SAGALayer
from .layers import GGCN, SAGAGAT, SAGAGCN

__all__ = ["GGCN", "SAGAGAT", "SAGAGCN", "SAGALayer", "SAGAProgram", "compile_apply_edge"]
