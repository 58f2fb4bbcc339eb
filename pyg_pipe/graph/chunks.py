"""The graph cut into chunks: each chunk's local graph and its halo.

After :func:`~pyg_pipe.graph.make_chunks` renumbers the vertices, chunk ``c`` owns the new ids
``ptr[c]:ptr[c+1]`` (its *rows*). A layer computes a chunk's rows from the chunk's **local graph**::

    local vertex ids   0 .. rows-1 | rows .. rows+H-1
                       chunk rows  | halo

    local edges        every edge into a chunk row (``row_edges`` of them), then the self loops of
                       halo vertices (user edge ids kept in ``edge_ids``)

A layer that computes only the chunk's rows takes the *row graph*: the first ``row_edges`` local edges
(sources among all local vertices, destinations among the rows; :attr:`LocalGraph.row_edge_index`,
:meth:`ChunkedGraph.local_adjacency` with ``rows_only``), a ``[rows, num_local]`` adjacency.

The **halo** is every vertex outside the chunk with an edge into it. A layer's output at a chunk
row depends on its in-edges and on what the layer reads at their sources, so with the true halo rows
(:mod:`pyg_pipe.engine.runtime.halo`) the chunk's rows equal the full graph's. Two things a chunk cannot see
locally are the degrees of its halo vertices (their other in-edges live in other chunks) and the
out-degrees of its vertices (their out-edges into other chunks): layers that normalise by them are
completed by :mod:`pyg_pipe.engine.step.degrees`, which is why halo self loops are kept (so the halo
vertices' self-loop handling matches the full graph's).

Everything here is vectorised over all chunks at once (sorting and counting, no per-chunk pass over
the edges): building a :class:`ChunkedGraph` is O(E log E), whatever the number of chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor


@dataclass
class LocalGraph:
    """One chunk's local view of the graph. All vertex ids are new (renumbered) ids.

    Attributes:
        index: chunk number ``c``.
        start, end: the chunk's rows are the new ids ``start .. end-1``.
        halo: [H] new ids of the halo vertices, ascending.
        halo_chunk: [H] the chunk owning each halo vertex.
        edge_index: [2, E_loc] local edges (source, destination in local ids).
        edge_ids: [E_loc] user edge id of every local edge.
        row_edges: how many of them lead into the chunk's rows (the first ones; the rest are halo self
            loops).
        rows, num_local, num_edges: the chunk's rows, its local vertices (rows and halo), its local edges.
    """

    index: int
    start: int
    end: int
    halo: Tensor
    halo_chunk: Tensor
    edge_index: Tensor
    edge_ids: Tensor
    row_edges: int = -1

    def __post_init__(self):
        # sizes read at every layer call on the chunk: kept as numbers (the tensors above are never replaced)
        self.rows = self.end - self.start
        self.num_local = self.rows + self.halo.numel()
        self.num_edges = self.edge_index.size(1)

    @property
    def row_edge_index(self) -> Tensor:
        """[2, row_edges] the local edges into the chunk's rows: the graph of a layer computing those rows only
        (the same object every time)."""
        hit = getattr(self, "_row_edge_index", None)
        if hit is None:
            hit = self._row_edge_index = self.edge_index[:, :self.row_edges]
        return hit

    @property
    def reversed_edges(self) -> Tensor:
        """[2, E_loc] the local edges turned around (destination, source): the graph of a layer that aggregates
        at ``edge_index[0]`` (``flow="target_to_source"``) when this is a chunk of the transposed graph (the same
        object every time)."""
        hit = getattr(self, "_reversed", None)
        if hit is None:
            hit = self._reversed = self.edge_index.flip(0)
        return hit

    @property
    def nodes(self) -> Tensor:
        """[num_local] new ids of the local vertices."""
        hit = getattr(self, "_nodes", None)
        if hit is None:
            hit = self._nodes = torch.cat([torch.arange(self.start, self.end, device=self.halo.device), self.halo])
        return hit


class ChunkedGraph:
    """A graph in renumbered vertex ids, cut into contiguous chunks, with every chunk's local graph.

    Args:
        src, dst: [E] edge endpoints in the user's (original) vertex ids and edge order.
        num_nodes: number of vertices N.
        perm: [N] ``perm[new] = old``.
        ptr: [C + 1] chunk boundaries in new ids.
        ways: graph-parallel ways; chunk ``c`` belongs to way ``c // (C / ways)`` (for :meth:`mirrors`).

    Per chunk: ``self.chunks[c]`` (a :class:`LocalGraph`). Whole graph: ``new_src`` / ``new_dst`` (the
    edges in new ids, user edge order), ``inv`` (old -> new id), ``chunk_of`` (new id -> chunk).
    Another chunking of the same vertex order (:meth:`rechunked`) and the transpose (:meth:`flipped`)
    share the renumbered edges instead of keeping copies.
    """

    def __init__(self, src: Tensor, dst: Tensor, num_nodes: int, perm: Tensor, ptr: Tensor, ways: int = 1):
        perm = perm.to(src.device)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(int(num_nodes), device=src.device)
        self._build(inv[src], inv[dst], num_nodes, perm, inv, ptr, ways)

    def rechunked(self, ptr: Tensor, ways: int) -> "ChunkedGraph":
        """The same graph and vertex order cut at other chunk bounds (the one-chunk-per-way chunking)."""
        out = ChunkedGraph.__new__(ChunkedGraph)
        out._build(self.new_src, self.new_dst, self.num_nodes, self.perm, self.inv, ptr, ways)
        return out

    def flipped(self) -> "ChunkedGraph":
        """The transposed graph (every edge reversed) in the same chunks."""
        out = ChunkedGraph.__new__(ChunkedGraph)
        out._build(self.new_dst, self.new_src, self.num_nodes, self.perm, self.inv, self.ptr, self.ways)
        return out

    def _build(self, s: Tensor, d: Tensor, num_nodes: int, perm: Tensor, inv: Tensor, ptr: Tensor, ways: int):
        device = s.device
        N, E, C = int(num_nodes), s.numel(), ptr.numel() - 1
        self.num_nodes, self.num_edges, self.num_chunks, self.ways = N, E, C, ways
        self.device = device
        self.perm, self.inv = perm, inv
        self.ptr = ptr.to(device)
        self.chunk_of = torch.bucketize(torch.arange(N, device=device), self.ptr[1:], right=True)
        ptr_list = self.ptr.tolist()
        starts = self.ptr[:-1]
        rows = self.ptr[1:] - starts
        self.new_src, self.new_dst = s, d
        cs, cd = self.chunk_of[s], self.chunk_of[d]
        cross = cs != cd

        # halo pairs (chunk, vertex), sorted by chunk then vertex
        pairs, pair_of_cross = torch.unique(cd[cross] * N + s[cross], return_inverse=True)
        pair_chunk, pair_v = pairs // N, pairs % N
        P = pairs.numel()
        hptr = torch.searchsorted(pair_chunk, torch.arange(C + 1, device=device)).tolist()

        # local ids of every edge's endpoints (w.r.t. its destination chunk)
        hstart = torch.tensor(hptr[:-1], dtype=torch.long, device=device)
        loc_src = torch.empty(E, dtype=torch.long, device=device)
        loc_src[~cross] = s[~cross] - starts[cd[~cross]]
        loc_src[cross] = rows[cd[cross]] + (pair_of_cross - hstart[cd[cross]])
        loc_dst = d - starts[cd]

        # self loops of halo vertices: every loop edge of h, once per chunk that has h in its halo
        loop_e = torch.nonzero(s == d).view(-1)
        loop_v, order = torch.sort(s[loop_e], stable=True)
        loop_e = loop_e[order]
        lo = torch.searchsorted(loop_v, pair_v)
        cnt = torch.searchsorted(loop_v, pair_v, right=True) - lo
        pl = torch.repeat_interleave(torch.arange(P, device=device), cnt)
        first = torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
        hl_edge = loop_e[lo[pl] + torch.arange(pl.numel(), device=device) - first]
        hl_chunk = pair_chunk[pl]
        hl_local = rows[hl_chunk] + (pl - hstart[hl_chunk])

        chunk = torch.cat([cd, hl_chunk])
        order = torch.argsort(chunk * 2 + torch.cat([torch.zeros_like(cd), torch.ones_like(hl_chunk)]), stable=True)
        edge_ids = torch.cat([torch.arange(E, device=device), hl_edge])[order]
        local_src = torch.cat([loc_src, hl_local])[order]
        local_dst = torch.cat([loc_dst, hl_local])[order]
        eptr = torch.searchsorted(chunk[order], torch.arange(C + 1, device=device)).tolist()
        into_rows = torch.bincount(cd, minlength=C).tolist()
        self.chunks: List[LocalGraph] = []
        for c in range(C):
            a, b = hptr[c], hptr[c + 1]
            e0, e1 = eptr[c], eptr[c + 1]
            self.chunks.append(LocalGraph(
                index=c, start=ptr_list[c], end=ptr_list[c + 1], halo=pair_v[a:b],
                halo_chunk=self.chunk_of[pair_v[a:b]], edge_index=torch.stack([local_src[e0:e1], local_dst[e0:e1]]),
                edge_ids=edge_ids[e0:e1], row_edges=into_rows[c]))
        self._mirrors: Optional[Dict[Tuple[int, int], Tensor]] = None
        self._degrees: Dict = {}

    def dropped(self) -> "ChunkedGraph":
        """A chunking of this graph with some of its edges left out (DropEdge, :mod:`pyg_pipe.engine.step.dropedge`):
        the same vertices, chunks, halos and ways; :meth:`keep_edges` chooses the edges (all, until called)."""
        out = ChunkedGraph.__new__(ChunkedGraph)
        for name in ("num_nodes", "num_chunks", "ways", "device", "perm", "inv", "ptr", "chunk_of"):
            setattr(out, name, getattr(self, name))
        out._base, out._mirrors = self, self.mirrors()  # (the halos are the same, so are the rows ways read)
        out.keep_edges(torch.ones(self.num_edges, dtype=torch.bool, device=self.device))
        return out

    def keep_edges(self, keep: Tensor) -> None:
        """A :meth:`dropped` chunking keeps the edges ``keep`` marks ([E] bool in the user's edge order of the graph
        it was made from), in place: every chunk keeps its local edges whose user edge is kept (a halo vertex's
        self loop with its loop), in their order; edge ids become positions among the kept edges."""
        base = self._base
        self.new_src, self.new_dst = base.new_src[keep], base.new_dst[keep]
        self.num_edges = int(self.new_src.numel())
        position = torch.cumsum(keep, 0) - 1
        self.chunks, self.local_keep = [], []
        for lg in base.chunks:
            k = keep[lg.edge_ids]
            self.chunks.append(LocalGraph(index=lg.index, start=lg.start, end=lg.end, halo=lg.halo,
                                          halo_chunk=lg.halo_chunk, edge_index=lg.edge_index[:, k],
                                          edge_ids=position[lg.edge_ids[k]], row_edges=int(k[:lg.row_edges].sum())))
            self.local_keep.append(k)
        self._degrees = {}
        for name in ("_inferred_nodes", "_repeated_loops"):
            self.__dict__.pop(name, None)

    # ------------------------------------------------------------------ edge tensors
    def local_edges(self, lg: LocalGraph, value: Tensor) -> Tensor:
        """[E_loc, ...] rows of an edge tensor (user edge order) for a chunk's local edges."""
        return value.index_select(0, lg.edge_ids)

    def local_adjacency(self, lg: LocalGraph, values: Optional[Tensor], layout, dtype: torch.dtype,
                        rows_only: bool = False) -> Tensor:
        """The chunk's local graph as a ``[num_local, num_local]`` sparse ``adj_t`` (rows are
        destinations) of ``layout``, with the given edge values (ones for ``None``); ``rows_only``: its
        row graph, ``[rows, num_local]``."""
        n = lg.row_edges if rows_only else lg.num_edges
        w = torch.ones(n, dtype=dtype, device=self.device) if values is None \
            else values.index_select(0, lg.edge_ids[:n]).to(dtype)
        src, dst = lg.edge_index[:, :n]
        shape = (lg.rows if rows_only else lg.num_local, lg.num_local)
        adj = torch.sparse_coo_tensor(torch.stack([dst, src]), w, shape).coalesce()
        return adj.to_sparse_csr() if layout == torch.sparse_csr else adj

    def inferred_loops(self, lg: LocalGraph) -> Optional[Tensor]:
        """Which of chunk ``lg``'s rows PyG's self-loop helpers give a loop when they infer the vertex count
        from the whole graph (its largest vertex id + 1: trailing isolated vertices get none), as a mask over
        the rows; ``None`` when every row gets one. Cached per chunk."""
        hit = getattr(lg, "_inferred_loops", False)
        if hit is False:
            n = getattr(self, "_inferred_nodes", None)
            if n is None:
                n = self._inferred_nodes = int(self.perm[torch.cat([self.new_src, self.new_dst])].max()) + 1 \
                    if self.new_src.numel() else 0
            keep = self.perm[lg.start:lg.end] < n
            hit = lg._inferred_loops = None if bool(keep.all()) else keep
        return hit

    @property
    def repeated_loops(self) -> bool:
        """Whether some vertex has more than one self loop."""
        hit = getattr(self, "_repeated_loops", None)
        if hit is None:
            loops = self.new_src[self.new_src == self.new_dst]
            hit = self._repeated_loops = bool(torch.unique(loops).numel() != loops.numel())
        return hit

    def in_degree(self, weight: Optional[Tensor], add_self_loops: bool, fill: float, dtype: torch.dtype) -> Tensor:
        """[N] the degree ``gcn_norm`` computes for every vertex (new ids) on the whole graph, for a 1-D
        edge weight in user edge order (``None``: ones). With ``add_self_loops`` a vertex's self loop
        keeps its weight and a vertex without one gets ``fill`` (with no weights every loop weighs 1,
        as in PyG). Needs at most one self loop per vertex (:attr:`repeated_loops`). Cached."""
        key = ("in", None if weight is None else id(weight), None if weight is None else weight._version,
               add_self_loops, fill, dtype)
        hit = self._degrees.get(key)
        if hit is not None and (weight is None or hit[0] is weight):
            return hit[1]
        loop = self.new_src == self.new_dst
        w = torch.ones(self.num_edges, dtype=torch.float64, device=self.device) if weight is None \
            else weight.detach().to(torch.float64)
        if add_self_loops:
            has_loop = torch.zeros(self.num_nodes, dtype=torch.bool, device=self.device)
            has_loop[self.new_src[loop]] = True
            extra = torch.where(has_loop, 0.0, 1.0 if weight is None else float(fill)).to(torch.float64)
            if weight is None:  # PyG replaces every loop by one of weight 1
                w = torch.where(loop, torch.zeros_like(w), w)
                extra = torch.ones(self.num_nodes, dtype=torch.float64, device=self.device)
        else:
            extra = torch.zeros(self.num_nodes, dtype=torch.float64, device=self.device)
        deg = extra.index_add_(0, self.new_dst, w)
        if len(self._degrees) > 16:
            self._degrees.clear()
        self._degrees[key] = (weight, deg.to(dtype))
        return self._degrees[key][1]

    def out_degree(self, weight: Optional[Tensor], dtype: torch.dtype, reverse: bool = False) -> Tensor:
        """[N] weighted out-degree of every vertex (new ids), self loops excluded, for a 1-D edge
        weight in user edge order (ones for ``None``); with ``reverse``, the in-degree (the out-degree of the
        graph this one transposes). Cached per weight tensor and version."""
        key = ("out", None if weight is None else id(weight), None if weight is None else weight._version, dtype,
               reverse)
        hit = self._degrees.get(key)
        if hit is not None and (weight is None or hit[0] is weight):
            return hit[1]
        w = torch.ones(self.num_edges, dtype=torch.float64, device=self.device) if weight is None \
            else weight.detach().to(torch.float64)
        w = torch.where(self.new_src == self.new_dst, torch.zeros_like(w), w)
        deg = torch.zeros(self.num_nodes, dtype=torch.float64, device=self.device).index_add_(
            0, self.new_dst if reverse else self.new_src, w)
        if len(self._degrees) > 8:
            self._degrees.clear()
        self._degrees[key] = (weight, deg.to(dtype))
        return self._degrees[key][1]

    # ------------------------------------------------------------------ graph-parallel ways
    @property
    def chunks_per_way(self) -> int:
        return self.num_chunks // self.ways

    def mirrors(self) -> Dict[Tuple[int, int], Tensor]:
        """``{(c, w): ids}``: the rows of chunk ``c`` (new ids, ascending) that chunks of another way
        ``w`` read. Way ``c // cpw`` sends them to way ``w`` when chunk ``c`` runs."""
        if self._mirrors is None:
            cpw, N = self.chunks_per_way, self.num_nodes
            out: Dict[Tuple[int, int], Tensor] = {}
            if self.ways > 1:
                pair_chunk = torch.cat([torch.full_like(lg.halo, lg.index) for lg in self.chunks])
                pair_v = torch.cat([lg.halo for lg in self.chunks])
                reader = pair_chunk // cpw
                keep = self.chunk_of[pair_v] // cpw != reader
                key = torch.unique(reader[keep] * N + pair_v[keep])     # sorted by reader way, then vertex
                rw, v = key // N, key % N
                gkey = self.chunk_of[v] * self.ways + rw
                order = torch.argsort(gkey, stable=True)
                gkey, v = gkey[order], v[order]
                b = torch.searchsorted(gkey, torch.arange(self.num_chunks * self.ways + 1, device=self.device)).tolist()
                for c in range(self.num_chunks):
                    for w in range(self.ways):
                        if w != c // cpw:
                            out[(c, w)] = v[b[c * self.ways + w]:b[c * self.ways + w + 1]]
            self._mirrors = out
        return self._mirrors


def derived(cache: Dict, cg: ChunkedGraph, kind, step: int = 0, seed: int = 0) -> ChunkedGraph:
    """The chunking of a graph derived from ``cg`` (same vertex order), kept in ``cache`` under ``(id(cg), kind)``:
    ``"flip"``, its transpose; ``("drop", m, k, p)``, the edges the ``k``-th DropEdge call in the ``m``-th call of the
    model keeps at training step ``step`` (:func:`edge_keep`; one object per call, its edges drawn again when the step
    changes); ``("drop nodes", m, k, p)``, the same for a DropNode call: the edges between the vertices it keeps
    (:func:`node_keep`, kept as the chunking's ``node_keep``)."""
    key = (id(cg), kind)
    hit = cache.get(key)
    if hit is None:
        if kind != "flip" and not (isinstance(kind, tuple) and kind[0] in ("drop", "drop nodes")):
            raise ValueError(kind)
        hit = cache[key] = cg.flipped() if kind == "flip" else cg.dropped()
    if kind != "flip" and getattr(hit, "step", None) != step:
        if kind[0] == "drop":
            hit.keep_edges(edge_keep(cg.num_edges, kind[3], seed, step, kind[1:3], cg.device))
        else:
            hit.node_keep = node_keep(cg.num_nodes, kind[3], seed, step, kind[1:3], cg.device)
            hit.keep_edges(hit.node_keep[cg.perm[cg.new_src]] & hit.node_keep[cg.perm[cg.new_dst]])
        hit.step = step
    return hit


def _draw(seed: int, step: int, draw: Tuple[int, int], device, salt: int = 0) -> torch.Generator:
    """A generator seeded by ``(seed, step, m, k)`` (and ``salt``, another stream for another kind of draw)."""
    key = ((int(seed) * 1_000_003 + int(step)) * 1_009 + int(draw[0])) * 1_013 + int(draw[1])
    if salt:
        key = key * 1_019 + salt
    gen = torch.Generator(device=device)
    gen.manual_seed(key % (2 ** 63))
    return gen


def edge_keep(num_edges: int, p: float, seed: int, step: int, draw: Tuple[int, int], device) -> Tensor:
    """[E] bool: the edges DropEdge keeps (each with probability ``1 - p``) at training step ``step`` in draw
    ``(m, k)`` (the ``k``-th DropEdge call in the ``m``-th call of the model), in the user's edge order: a draw from a
    generator seeded by ``(seed, step, m, k)``, so every rank, chunk, stage and replay of the step gets the same edges
    without communicating."""
    return torch.rand(num_edges, generator=_draw(seed, step, draw, device), device=device) >= p


def node_keep(num_nodes: int, p: float, seed: int, step: int, draw: Tuple[int, int], device) -> Tensor:
    """[N] bool: the vertices DropNode keeps (each with probability ``1 - p``, as PyG's ``dropout_node``: a vertex
    is kept where its draw is above ``p``) at training step ``step`` in draw ``(m, k)``, in the user's vertex order;
    seeded as :func:`edge_keep`, on a stream of its own."""
    return torch.rand(num_nodes, generator=_draw(seed, step, draw, device, salt=1), device=device) > p


def way_ptr(ptr: Tensor, ways: int) -> Tensor:
    """Chunk boundaries of the *way chunking*: each way's chunks merged into one chunk."""
    cpw = (ptr.numel() - 1) // ways
    return ptr[::cpw].clone()
