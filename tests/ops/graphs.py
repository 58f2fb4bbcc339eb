"""Tiny CSR graphs and the pure-torch reference aggregation the kernel tests compare against."""
import torch

REDUCES = ("sum", "mean", "max")


def small_csr(num_nodes=23, num_edges=120, seed=0, index_dtype=torch.int64):
    """A random CSR with empty destination rows (3, 4, 17) and an isolated vertex (11: no edges at all).

    Returns ``rowptr`` [N+1], ``col`` [E] (sorted by row, then by column, duplicates allowed).
    """
    gen = torch.Generator().manual_seed(seed)
    dst = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    keep = ~torch.isin(dst, torch.tensor([3, 4, 11, 17])) & (src != 11)
    dst, src = dst[keep], src[keep]
    order = torch.argsort(dst * num_nodes + src)
    dst, src = dst[order], src[order]
    rowptr = torch.zeros(num_nodes + 1, dtype=torch.int64)
    rowptr[1:] = torch.cumsum(torch.bincount(dst, minlength=num_nodes), 0)
    return rowptr.to(index_dtype), src.to(index_dtype)


def reference(rowptr, col, x, value=None, reduce="sum", row_start=0, row_end=None):
    """Edge-list aggregation with index_select + scatter_reduce (what PyG's default path does)."""
    row_end = rowptr.numel() - 1 if row_end is None else row_end
    rp = rowptr[row_start:row_end + 1].long()
    base, end = int(rp[0]), int(rp[-1])
    dst = torch.repeat_interleave(torch.arange(row_end - row_start, device=x.device), rp[1:] - rp[:-1])
    msg = x.index_select(0, col[base:end].long())
    if value is not None:
        msg = msg * value[base:end].unsqueeze(1)
    out = x.new_zeros(row_end - row_start, x.size(1))
    red = {"sum": "sum", "mean": "mean", "max": "amax"}[reduce]
    return out.scatter_reduce(0, dst.unsqueeze(1).expand_as(msg), msg, red, include_self=False)
