"""The graph cut into chunks: contiguous vertex ranges and each chunk's degree-complete local graph.

After :func:`pyg_pipe.graph.make_chunks` reorders the vertices, chunk ``c`` owns the new ids
``ptr[c]:ptr[c+1]``. A message-passing layer computes the rows of one chunk from a *local graph*:

* local vertices = the chunk's rows first, then its **halo** (in-neighbours outside the chunk),
  then, when needed, one **dummy** vertex;
* local edges = every edge into the chunk, plus the self loops of halo vertices;
* **degree-completing edges**: a halo vertex sees only part of its in-edges locally, so layers whose
  normalisation reads source degrees (GCN's ``D^-1/2 A D^-1/2``) would use a wrong degree. For every
  halo vertex ``v`` whose weighted in-degree is incomplete, one edge ``dummy -> v`` carries the missing
  weight. Messages along these edges only reach halo rows, whose outputs are discarded, so the chunk's
  rows equal the full-graph result for any layer whose output at a vertex depends on its in-edges and
  on weighted in-degrees. With ``complete_out=True`` edges ``v -> dummy`` also complete out-degrees
  (for normalisations by source out-degree, such as ``get_laplacian``); off by default, since each
  costs as much as a real edge.

The completed variant is used for layers that take ``edge_weight`` (and for sparse adjacencies, whose
values are the weights); other layers get the plain local edge list.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor


@dataclass
class Chunk:
    """One chunk's local view of the graph (all ids are new, reordered ids)."""

    index: int
    start: int
    end: int
    halo: Tensor              # [H] new ids of halo vertices, ascending
    halo_chunk: Tensor        # [H] chunk of each halo vertex
    edge_ids: Tensor          # [E_c] ids (in the user's edge order) of the real local edges
    src: Tensor               # [E_c] local source ids
    dst: Tensor               # [E_c] local destination ids
    dummy_src: Tensor         # [D] local ids of degree-completing edges
    dummy_dst: Tensor
    dummy_weight: Tensor      # [D] missing weight (float64)
    _variants: Dict[Tuple, object] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def has_dummy(self) -> bool:
        return self.dummy_src.numel() > 0

    @property
    def num_local(self) -> int:
        return self.rows + self.halo.numel() + int(self.has_dummy)


class ChunkedGraph:
    """A graph in reordered ids, cut into ``len(ptr) - 1`` chunks.

    Args:
        src, dst: [E] edge endpoints in the user's (original) ids and edge order.
        weight: [E] edge weights or ``None`` (all ones); used for degree completion.
        num_nodes: number of vertices.
        perm: [N] ``perm[new] = old``.
        ptr: [C + 1] chunk boundaries in new ids.
        sparse_layout: ``None`` when layers take ``edge_index``; else the torch sparse layout of the
            user's ``adj_t`` (local graphs are then built as sparse matrices of the same layout).
    """

    def __init__(self, src: Tensor, dst: Tensor, weight: Optional[Tensor], num_nodes: int, perm: Tensor,
                 ptr: Tensor, sparse_layout=None, complete_out: bool = False):
        device = src.device
        self.num_nodes = num_nodes
        self.perm = perm.to(device)
        self.inv = torch.empty_like(self.perm)
        self.inv[self.perm] = torch.arange(num_nodes, device=device)
        self.ptr = ptr.to(device)
        self.sparse_layout = sparse_layout
        self.num_chunks = ptr.numel() - 1
        self.layer_cache: Dict[Tuple[int, int], Dict] = {}  # (id(layer), chunk) -> cached normalisation
        src_n, dst_n = self.inv[src], self.inv[dst]
        w = torch.ones(src.numel(), dtype=torch.float64, device=device) if weight is None else weight.double()
        in_deg = torch.zeros(num_nodes, dtype=torch.float64, device=device).index_add_(0, dst_n, w)
        out_deg = torch.zeros(num_nodes, dtype=torch.float64, device=device).index_add_(0, src_n, w)
        chunk_of = torch.bucketize(torch.arange(num_nodes, device=device), self.ptr[1:], right=True)
        self.chunk_of = chunk_of
        order = torch.argsort(dst_n, stable=True)
        bounds = torch.searchsorted(dst_n[order], self.ptr)
        is_loop = src_n == dst_n
        self.chunks = []
        for c in range(self.num_chunks):
            start, end = int(self.ptr[c]), int(self.ptr[c + 1])
            e_in = order[int(bounds[c]):int(bounds[c + 1])]
            s_in = src_n[e_in]
            outside = (s_in < start) | (s_in >= end)
            halo = torch.unique(s_in[outside])
            # self loops of halo vertices keep add_remaining_self_loops semantics identical
            loop_ids = torch.nonzero(is_loop & torch.isin(src_n, halo)).view(-1) if halo.numel() else e_in[:0]
            edge_ids = torch.cat([e_in, loop_ids])
            rows = end - start
            local = torch.full((num_nodes,), -1, dtype=torch.long, device=device)
            local[start:end] = torch.arange(rows, device=device)
            local[halo] = torch.arange(rows, rows + halo.numel(), device=device)
            l_src, l_dst = local[src_n[edge_ids]], local[dst_n[edge_ids]]
            # degree completion
            nodes = torch.cat([torch.arange(start, end, device=device), halo])
            n_loc = nodes.numel()
            lw = w[edge_ids]
            loc_in = torch.zeros(n_loc, dtype=torch.float64, device=device).index_add_(0, l_dst, lw)
            loc_out = torch.zeros(n_loc, dtype=torch.float64, device=device).index_add_(0, l_src, lw)
            miss_in = in_deg[nodes] - loc_in
            miss_out = out_deg[nodes] - loc_out
            miss_in[:rows] = 0.0  # every in-edge of a chunk row is local
            tol = 1e-9 * (1.0 + in_deg[nodes].abs())
            need_in = torch.nonzero(miss_in > tol).view(-1)
            need_out = torch.nonzero(miss_out > 1e-9 * (1.0 + out_deg[nodes].abs())).view(-1) if complete_out \
                else need_in[:0]
            dummy = torch.full((need_in.numel(),), n_loc, dtype=torch.long, device=device)
            dummy_o = torch.full((need_out.numel(),), n_loc, dtype=torch.long, device=device)
            self.chunks.append(Chunk(
                c, start, end, halo, chunk_of[halo], edge_ids, l_src, l_dst,
                dummy_src=torch.cat([dummy, need_out]), dummy_dst=torch.cat([need_in, dummy_o]),
                dummy_weight=torch.cat([miss_in[need_in], miss_out[need_out]]),
            ))

    def local_graph(self, chunk: Chunk, complete: bool, weight: Optional[Tensor], dtype: torch.dtype):
        """The chunk's local connectivity in the user's form, and its edge weights.

        Returns ``(graph, edge_weight)``: ``graph`` is a [2, E_loc] ``edge_index`` (or a sparse
        ``adj_t`` whose values are the weights, ``edge_weight`` then ``None``). With
        ``complete=True`` the degree-completing edges are appended (weights always given).
        ``weight`` holds the user's weights in original edge order (``None`` = ones).
        Results are cached per chunk.
        """
        key = (complete, None if weight is None else (weight.data_ptr(), weight._version), dtype)
        hit = chunk._variants.get(key)
        if hit is not None:
            return hit
        src, dst = chunk.src, chunk.dst
        w = None if weight is None else weight[chunk.edge_ids].to(dtype)
        if complete and chunk.has_dummy:
            ones = torch.ones(chunk.src.numel(), dtype=dtype, device=src.device)
            w = torch.cat([ones if w is None else w, chunk.dummy_weight.to(dtype)])
            src, dst = torch.cat([src, chunk.dummy_src]), torch.cat([dst, chunk.dummy_dst])
        elif complete and w is None:
            w = torch.ones(src.numel(), dtype=dtype, device=src.device)
        n = chunk.num_local
        if self.sparse_layout is not None:
            vals = torch.ones(src.numel(), dtype=dtype, device=src.device) if w is None else w
            adj = torch.sparse_coo_tensor(torch.stack([dst, src]), vals, (n, n)).coalesce()
            if self.sparse_layout == torch.sparse_csr:
                adj = adj.to_sparse_csr()
            out = (adj, None)
        else:
            out = (torch.stack([src, dst]), w)
        chunk._variants.clear() if len(chunk._variants) > 8 else None
        chunk._variants[key] = out
        return out

    def dummy_edges(self, chunk: Chunk, complete: bool) -> int:
        """How many degree-completing edges the chunk's local graph appends."""
        return chunk.dummy_src.numel() if complete else 0
