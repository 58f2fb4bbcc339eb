"""The graph side of pyg_pipe: partitioning and chunking vertices, and offline graph generators."""

from .chunks import ChunkedGraph, LocalGraph
from .generate import karate_club, load_dataset, powerlaw_graph, sbm_graph
from .partition import PARTITION_METHODS, cut_edges, make_chunks, make_way_chunks, partition_nodes

__all__ = [
    "ChunkedGraph",
    "LocalGraph",
    "partition_nodes",
    "make_chunks",
    "make_way_chunks",
    "cut_edges",
    "PARTITION_METHODS",
    "sbm_graph",
    "powerlaw_graph",
    "karate_club",
    "load_dataset",
]
