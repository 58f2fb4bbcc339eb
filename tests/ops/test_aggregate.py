"""``csr_aggregate`` equals the pure-torch edge-list aggregation: values, gradients, gradcheck.

Covers sum / mean / max, with and without edge weights, empty rows and an isolated vertex, row
ranges at the start, middle and end of the graph, int32 and int64 indices, float32 and float64,
feature widths that exercise every register-block size and the tail, and the fallback paths
(``torch`` without the compiled kernel).
"""
import pytest
import torch

from pyg_pipe import ops
from pyg_pipe.ops import build, transpose
from tests.ops.graphs import REDUCES, reference, small_csr

N = 23
RANGES = {"all": (0, N), "start": (0, 7), "middle": (5, 16), "end": (15, N), "empty": (3, 5)}


def _compare(rowptr, col, x, value, reduce, rs, re, atol):
    inputs = [x] + ([value] if value is not None else [])
    out = ops.csr_aggregate(rowptr, col, x, value=value, reduce=reduce, row_start=rs, row_end=re)
    ref = reference(rowptr, col, x, value, reduce, rs, re)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad, allow_unused=True)
    want = torch.autograd.grad(ref, inputs, grad, allow_unused=True)
    for g, w in zip(got, want):
        w = torch.zeros_like(g) if w is None else w
        torch.testing.assert_close(g, w, atol=atol, rtol=atol)


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("rows", list(RANGES), ids=list(RANGES))
def test_matches_reference(reduce, weighted, index_dtype, dtype, rows):
    rowptr, col = small_csr(N, index_dtype=index_dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 37, generator=gen, dtype=dtype).requires_grad_()
    value = torch.rand(col.numel(), generator=gen, dtype=dtype).add_(0.1).requires_grad_() if weighted else None
    rs, re = RANGES[rows]
    _compare(rowptr, col, x, value, reduce, rs, re, atol=1e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("width", [1, 5, 8, 16, 24, 64, 130, 300])
def test_feature_widths(reduce, width):
    """Every register-block size of the kernel (128/64/32/16/8 and the scalar tail)."""
    rowptr, col = small_csr(N, seed=2)
    x = torch.randn(N, width).requires_grad_()
    value = torch.rand(col.numel()).requires_grad_()
    _compare(rowptr, col, x, value, reduce, 0, N, atol=1e-5)
    _compare(rowptr, col, x.detach().double().requires_grad_(), None, reduce, 4, 20, atol=1e-12)


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("rows", ["all", "middle", "end"])
def test_gradcheck(reduce, weighted, rows):
    rowptr, col = small_csr(N, num_edges=70, seed=3, index_dtype=torch.int32)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(N, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    value = (torch.rand(col.numel(), generator=gen, dtype=torch.float64) + 0.5).requires_grad_() if weighted else None
    rs, re = RANGES[rows]
    inputs = (x, value) if weighted else (x,)

    def fn(*args):
        return ops.csr_aggregate(rowptr, col, args[0], value=args[1] if weighted else None, reduce=reduce,
                                 row_start=rs, row_end=re)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_chunk_rowptr_slice_equals_row_range():
    """A chunk's rowptr slice (absolute offsets, not rebased) with the full col is the row-range call."""
    rowptr, col = small_csr(N)
    x = torch.randn(N, 16)
    for reduce in REDUCES:
        a = ops.csr_aggregate(rowptr, col, x, reduce=reduce, row_start=8, row_end=19)
        b = ops.csr_aggregate(rowptr[8:20], col, x, reduce=reduce)
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_isolated_vertex_and_empty_rows_are_zero():
    rowptr, col = small_csr(N)
    x = torch.randn(N, 4, requires_grad=True)
    for reduce in REDUCES:
        out = ops.csr_aggregate(rowptr, col, x, reduce=reduce)
        assert out[[3, 4, 11, 17]].abs().sum() == 0
        (grad_x,) = torch.autograd.grad(out.sum(), x)
        assert grad_x[11].abs().sum() == 0  # never a source


def test_noncontiguous_and_mixed_inputs():
    """Non-contiguous x, int32 rowptr with int64 col, and values of another dtype are accepted."""
    rowptr, col = small_csr(N)
    x = torch.randn(8, N).t()  # [N, 8], not contiguous
    value = torch.rand(col.numel(), dtype=torch.float64)
    out = ops.csr_aggregate(rowptr.int(), col, x, value=value, reduce="sum")
    torch.testing.assert_close(out, reference(rowptr, col, x.contiguous(), value.float()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduce,learned", [("sum", False), ("mean", False), ("sum", True), ("max", False)])
def test_sources_kept_only_when_the_backward_reads_them(reduce, learned):
    """A sum or mean over constant weights does not keep its sources alive for the backward (in a chunk
    they are the joined ``[rows | halo]`` copy); the max and learned edge weights do. Gradients are right
    either way."""
    import weakref

    if ops.backend() not in ("cpp", "cuda"):
        pytest.skip("the compiled kernels' autograd (the fallbacks keep what torch keeps)")
    rowptr, col = small_csr(N)
    leaf = torch.randn(N, 6, requires_grad=True)
    value = torch.rand(col.numel()).add_(0.1).requires_grad_(learned)
    x = leaf * 2.0  # not a leaf: only the aggregation's saved tensors can keep it alive
    ref = reference(rowptr, col, x, value, reduce)
    want = torch.autograd.grad(ref.sum(), leaf)
    x = leaf * 2.0
    alive = weakref.ref(x)
    out = ops.csr_aggregate(rowptr, col, x, value=value, reduce=reduce)
    del x
    kept = alive() is not None
    assert kept == (reduce == "max" or learned)
    (got,) = torch.autograd.grad(out.sum(), leaf)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


def test_transpose_cache_follows_the_graph():
    """The cached transposed adjacency is reused for one graph and rebuilt after an in-place edit."""
    ops.clear_cache()
    rowptr, col = small_csr(N)
    x = torch.randn(N, 4, requires_grad=True)
    for _ in range(2):
        ops.csr_aggregate(rowptr, col, x, reduce="mean").sum().backward()
    if ops.backend() in ("cpp", "cuda"):
        assert len(transpose._cache) == 1
    col[0] = (col[0] + 1) % N  # same memory, new version: must not reuse the old transpose
    x.grad = None
    out = ops.csr_aggregate(rowptr, col, x, reduce="mean")
    (got,) = torch.autograd.grad(out.sum(), x)
    (want,) = torch.autograd.grad(reference(rowptr, col, x, reduce="mean").sum(), x)
    torch.testing.assert_close(got, want)
    ops.clear_cache()
    assert len(transpose._cache) == 0


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_backward_weights_cached_follow_the_values(reduce):
    """The transposed edge weights the backward gathers are kept for the same ``value`` object, and gathered anew
    for a value changed in place, for another tensor (even at the same address) and for none: every gradient
    equals the reference's."""
    if ops.backend() not in ("cpp", "cuda"):
        pytest.skip("the transposes are cached by the compiled kernels' backward only")
    ops.clear_cache()
    rowptr, col = small_csr(N)
    x = torch.randn(N, 4, dtype=torch.float64, requires_grad=True)
    value = torch.rand(col.numel(), dtype=torch.float64)

    def check(v):
        out = ops.csr_aggregate(rowptr, col, x, value=v, reduce=reduce)
        (got,) = torch.autograd.grad(out.sum(), x)
        (want,) = torch.autograd.grad(reference(rowptr, col, x, v, reduce).sum(), x)
        torch.testing.assert_close(got, want)

    check(value)
    slot = transpose._cache[next(iter(transpose._cache))][5]
    check(value)  # reused: the very tensor kept
    assert transpose._cache[next(iter(transpose._cache))][5][2] is slot[2]
    value.mul_(3.0)  # the same object changed in place
    check(value)
    check(value.clone())  # another tensor with the same values
    del value
    check(torch.rand(col.numel(), dtype=torch.float64))  # a new one, perhaps at the freed address
    check(None)
    ops.clear_cache()


def test_held_lists_every_tensor_a_capture_may_read():
    """``transpose.held()`` (what a captured CUDA graph keeps alive) holds each entry's graph, transpose, edge
    weights and the value they came from: evicting the entry later must not free memory a replay reads."""
    if ops.backend() not in ("cpp", "cuda"):
        pytest.skip("the transposes are cached by the compiled kernels' backward only")
    ops.clear_cache()
    rowptr, col = small_csr(N)
    x = torch.randn(N, 4, requires_grad=True)
    ops.csr_aggregate(rowptr, col, x, value=torch.rand(col.numel()), reduce="mean").sum().backward()
    entry = next(iter(transpose._cache.values()))
    kept = transpose.held()
    for t in entry[:5] + [entry[5][0], entry[5][2]]:
        assert any(k is t for k in kept)
    ops.clear_cache()
    assert transpose.held() == [] and kept  # (the list still holds them)


@pytest.mark.parametrize("reduce", REDUCES)
def test_torch_fallback_matches_reference(reduce, monkeypatch):
    """Without the compiled kernel (``backend() == 'torch'``) the same call gives the same results."""
    monkeypatch.setattr(build, "_kernels", lambda kind: None)
    monkeypatch.setattr(build, "_torch_sparse", lambda: None)
    assert ops.backend() == "torch"
    rowptr, col = small_csr(N)
    x = torch.randn(N, 9, requires_grad=True)
    value = torch.rand(col.numel(), requires_grad=True)
    for rs, re in RANGES.values():
        _compare(rowptr, col, x, value, reduce, rs, re, atol=1e-5)
    # half precision takes the generic edge-list path
    out = ops.csr_aggregate(rowptr, col, x.detach().bfloat16(), reduce=reduce)
    torch.testing.assert_close(out.float(), reference(rowptr, col, x.detach(), reduce=reduce), atol=0.1, rtol=0.05)


def test_argument_errors():
    rowptr, col = small_csr(N)
    x = torch.randn(N, 3)
    with pytest.raises(ValueError, match="reduce"):
        ops.csr_aggregate(rowptr, col, x, reduce="min")
    with pytest.raises(ValueError, match="row_start"):
        ops.csr_aggregate(rowptr, col, x, row_start=5, row_end=3)
    with pytest.raises(ValueError, match="2-D"):
        ops.csr_aggregate(rowptr, col, x[:, 0])
    with pytest.raises(ValueError, match="value"):
        ops.csr_aggregate(rowptr, col, x, value=torch.ones(3))


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("width", [5, 16, 128, 130])
def test_cuda_matches_reference(reduce, weighted, index_dtype, width):
    rowptr, col = small_csr(N, index_dtype=index_dtype)
    for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        x = torch.randn(N, width, dtype=dtype, device="cuda", requires_grad=True)
        value = torch.rand(col.numel(), dtype=dtype, device="cuda", requires_grad=True) if weighted else None
        for rs, re in RANGES.values():
            _compare(rowptr.cuda(), col.cuda(), x, value, reduce, rs, re, atol=atol)


def _hub_csr(n=300, hub_degree=2000, seed=4, index_dtype=torch.int64):
    """A power-law-like CSR: row 7 has ``hub_degree`` edges, rows 0, 150-159 and n-1 none, the rest 0-5."""
    gen = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, 6, (n,), generator=gen)
    deg[7] = hub_degree
    deg[0] = deg[150:160] = deg[n - 1] = 0
    rowptr = torch.zeros(n + 1, dtype=torch.int64)
    rowptr[1:] = torch.cumsum(deg, 0)
    col = torch.randint(0, n, (int(rowptr[-1]),), generator=gen)
    col[rowptr[7]:rowptr[8]] = torch.arange(hub_degree) % 40  # the hub's sources: hub columns backward too
    return rowptr.to(index_dtype), col.to(index_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("slice_edges", [0, 1, 3, 64, 256, 100_000])
def test_cuda_edge_balanced_slices(slice_edges):
    """The edge-balanced sum/mean kernel (rows split across slices, then joined in slice order) equals the
    reference for every slice size: a hub row over many slices, rows ending exactly at a slice end,
    empty rows at the start, middle and end, row ranges of the CSR, and the backward (whose transposed
    graph has hub columns)."""
    module = build._kernels("cuda")
    assert module is not None, "CUDA is available but the CUDA kernel did not build"
    before = module.slice_edges()
    module.set_slice_edges(slice_edges)
    try:
        for index_dtype in (torch.int32, torch.int64):
            rowptr, col = _hub_csr(index_dtype=index_dtype)
            n = rowptr.numel() - 1
            for dtype, atol in ((torch.float32, 1e-4), (torch.float64, 1e-10)):
                x = torch.randn(n, 12, dtype=dtype, device="cuda", requires_grad=True)
                value = torch.rand(col.numel(), dtype=dtype, device="cuda", requires_grad=True)
                for reduce in ("sum", "mean"):
                    for v in (None, value):
                        for rs, re in ((0, n), (0, 8), (7, 8), (5, 160), (149, n), (150, 160)):
                            _compare(rowptr.cuda(), col.cuda(), x, v, reduce, rs, re, atol=atol)
            ops.clear_cache()
    finally:
        module.set_slice_edges(before)


def test_cuda_slice_edges_setting_is_validated(monkeypatch):
    monkeypatch.setenv(build.ENV_CUDA_SLICE_EDGES, "many")
    with pytest.raises(ValueError, match="PYG_PIPE_CUDA_SLICE_EDGES"):
        build._cuda_slice_edges()
    monkeypatch.setenv(build.ENV_CUDA_SLICE_EDGES, "0")
    assert build._cuda_slice_edges() == 0
    monkeypatch.delenv(build.ENV_CUDA_SLICE_EDGES)
    assert build._cuda_slice_edges() == build._CUDA_SLICE_EDGES


@pytest.mark.gpu
def test_cuda_backend_and_gradcheck():
    assert ops.backend("cuda") == "cuda", "CUDA is available but the CUDA kernel did not build"
    rowptr, col = small_csr(N, num_edges=70, seed=3)
    rowptr, col = rowptr.cuda(), col.cuda()
    for reduce in REDUCES:
        x = torch.randn(N, 6, dtype=torch.float64, device="cuda", requires_grad=True)
        value = (torch.rand(col.numel(), dtype=torch.float64, device="cuda") + 0.5).requires_grad_()
        assert torch.autograd.gradcheck(
            lambda a, v, r=reduce: ops.csr_aggregate(rowptr, col, a, value=v, reduce=r, row_start=2, row_end=20),
            (x, value), eps=1e-6, atol=1e-7)


def test_transpose_cache_is_bounded(monkeypatch):
    """Graphs built anew every step do not pile up: the cache keeps within its byte budget."""
    ops.clear_cache()
    monkeypatch.setattr(transpose, "_BYTES", 1)
    x = torch.randn(N, 4, requires_grad=True)
    for seed in range(3):
        rowptr, col = small_csr(N, seed=seed)
        ops.csr_aggregate(rowptr, col, x).sum().backward()
    if ops.backend() in ("cpp", "cuda"):
        assert len(transpose._cache) == 1  # only the newest
    ops.clear_cache()
