"""Compiled graph operators: fused CSR gather-aggregate kernels and their PyG integration.

``csr_aggregate`` is the kernel call and ``backend()`` says which implementation runs (see
:mod:`pyg_pipe.ops.aggregate`, built by :mod:`pyg_pipe.ops.build`); ``install`` / ``uninstall`` /
``fused_kernels`` route PyG's sparse-adjacency aggregation (``torch_geometric.utils.spmm``) to it (see
:mod:`pyg_pipe.ops.pyg`); ``fuse_messages(model)`` does the same for layers given an ``edge_index`` whose message
is the source row, optionally weighted per edge (see :mod:`pyg_pipe.ops.messages`).
"""

from pyg_pipe.ops import messages, transpose
from pyg_pipe.ops.aggregate import csr_aggregate, csr_gated_aggregate
from pyg_pipe.ops.build import ENV_DISABLE, backend, extensions_enabled
from pyg_pipe.ops.messages import fuse_messages
from pyg_pipe.ops.pyg import fused_kernels, install, installed, uninstall


def clear_cache() -> None:
    """Forget what the kernels keep per graph: the transposed adjacencies and their edge weights
    (:mod:`.transpose`), the CSRs of ``edge_index`` graphs and their weights in CSR order (:mod:`.messages`);
    each is rebuilt at its next use."""
    transpose.clear_cache()
    messages.clear_cache()

__all__ = [
    "ENV_DISABLE",
    "backend",
    "clear_cache",
    "csr_aggregate",
    "csr_gated_aggregate",
    "extensions_enabled",
    "fuse_messages",
    "fused_kernels",
    "install",
    "installed",
    "uninstall",
]
