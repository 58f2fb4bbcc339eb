"""Layers written in SAGA form (:class:`~pyg_pipe.saga.SAGALayer`): NGra's G-GCN, GCN and a GAT-style
attention layer. Each equals its PyG counterpart given the same weights (``tests/saga``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.nn.conv.gcn_conv import gcn_norm
from torch_geometric.utils import add_self_loops, remove_self_loops, softmax

from .layer import SAGALayer


class GGCN(SAGALayer):
    """NGra's gated graph ConvNet (Bresson & Laurent), PyG's ``ResGatedGraphConv``::

        ApplyEdge    m_ij = sigmoid(A x_i + B x_j) * V x_j
        Gather       sum
        ApplyVertex  h_i  = U x_i + sum_j m_ij + bias

    After the rewrite ``A x``, ``B x`` and ``V x`` are products per vertex and the Gather is the fused
    gated kernel (no per-edge tensor).
    """

    def __init__(self, in_channels: int, out_channels: int, **kwargs):
        super().__init__(gather="sum", **kwargs)
        self.A = nn.Linear(in_channels, out_channels)
        self.B = nn.Linear(in_channels, out_channels)
        self.V = nn.Linear(in_channels, out_channels)
        self.U = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_channels))

    def apply_edge(self, src: Tensor, dst: Tensor) -> Tensor:
        return torch.sigmoid(self.A(dst) + self.B(src)) * self.V(src)

    def apply_vertex(self, x: Tensor, gathered: Tensor) -> Tensor:
        return gathered + self.U(x) + self.bias


class SAGAGCN(SAGALayer):
    """Kipf & Welling's GCN (PyG's ``GCNConv``): the symmetric normalisation is the edge data::

        ApplyEdge    m_ij = w_ij * W x_j          w = gcn_norm(edge_index) (self-loops added)
        Gather       sum
        ApplyVertex  h_i  = sum_j m_ij + bias

    ``W x`` moves per vertex and the Gather is the fused weighted kernel.
    """

    def __init__(self, in_channels: int, out_channels: int, **kwargs):
        super().__init__(gather="sum", **kwargs)
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_channels))

    def forward(self, x: Tensor, edge_index: Tensor, edge_weight: Tensor = None) -> Tensor:
        edge_index, edge_weight = gcn_norm(edge_index, edge_weight, x.size(0), add_self_loops=True,
                                           flow=self.flow, dtype=x.dtype)
        return super().forward(x, edge_index, edge_weight)

    def apply_edge(self, src: Tensor, edge_attr: Tensor) -> Tensor:
        return edge_attr.view(-1, 1) * self.lin(src)

    def apply_vertex(self, x: Tensor, gathered: Tensor) -> Tensor:
        return gathered + self.bias


class SAGAGAT(SAGALayer):
    """A GAT layer (PyG's ``GATConv`` without dropout on the attention)::

        ApplyEdge    e_ij = leaky_relu(<a_s, W x_j> + <a_d, W x_i>),  a_ij = softmax_i(e_ij),  m_ij = a_ij W x_j
        Gather       sum
        ApplyVertex  h_i  = concat_heads(sum_j m_ij) + bias

    ``W x`` and both attention terms move per vertex; the softmax runs per edge on ``[E, heads]``
    scores; the Gather is the fused weighted kernel, once per head.
    """

    def __init__(self, in_channels: int, out_channels: int, heads: int = 1, negative_slope: float = 0.2,
                 add_self_loops: bool = True, **kwargs):
        super().__init__(gather="sum", **kwargs)
        self.heads, self.out_channels, self.negative_slope = heads, out_channels, negative_slope
        self.add_self_loops = add_self_loops
        self.lin = nn.Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        self.bias = nn.Parameter(torch.zeros(heads * out_channels))
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        if self.add_self_loops:
            edge_index, _ = remove_self_loops(edge_index)
            edge_index, _ = add_self_loops(edge_index, num_nodes=x.size(0))
        return super().forward(x, edge_index)

    def apply_edge(self, src: Tensor, dst: Tensor, index: Tensor, size_i: int) -> Tensor:
        h_j = self.lin(src).view(-1, self.heads, self.out_channels)
        h_i = self.lin(dst).view(-1, self.heads, self.out_channels)
        score = (h_j * self.att_src).sum(dim=-1) + (h_i * self.att_dst).sum(dim=-1)
        alpha = softmax(F.leaky_relu(score, self.negative_slope), index, num_nodes=size_i)
        return alpha.unsqueeze(-1) * h_j

    def apply_vertex(self, x: Tensor, gathered: Tensor) -> Tensor:
        return gathered.reshape(-1, self.heads * self.out_channels) + self.bias
