"""``csr_gated_aggregate`` (the G-GCN Gather) equals the edge-list formula: values and gradients, both
reductions, empty rows, row-range slices, int32/int64, float32/float64, feature widths around the
vector length, gates far in the tails of the sigmoid, the fallback without compiled kernels, CUDA."""
import pytest
import torch

from pyg_pipe import ops
from pyg_pipe.ops import build
from tests.ops.graphs import small_csr

N = 23


def reference(rowptr, col, a, b, c, reduce):
    rp = rowptr.long()
    base, end = int(rp[0]), int(rp[-1])
    deg = rp[1:] - rp[:-1]
    dst = torch.repeat_interleave(torch.arange(rp.numel() - 1), deg)
    src = col[base:end].long()
    msg = torch.sigmoid(a[dst] + b[src]) * c[src]
    out = torch.zeros(rp.numel() - 1, c.size(1), dtype=c.dtype).index_add_(0, dst, msg)
    return out / deg.clamp(min=1).unsqueeze(1).to(c.dtype) if reduce == "mean" else out


def _compare(rowptr, col, a, b, c, reduce, atol):
    out = ops.csr_gated_aggregate(rowptr, col, a, b, c, reduce)
    ref = reference(rowptr, col, a, b, c, reduce)
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (a, b, c), g), torch.autograd.grad(ref, (a, b, c), g)):
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)


def _inputs(rows, width, dtype, scale=1.0, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(rows, width, generator=gen, dtype=dtype) * scale).to(device).requires_grad_()
    b = (torch.randn(N, width, generator=gen, dtype=dtype) * scale).to(device).requires_grad_()
    c = torch.randn(N, width, generator=gen, dtype=dtype).to(device).requires_grad_()
    return a, b, c


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("width", [1, 5, 16, 64, 130])
def test_matches_reference(reduce, index_dtype, dtype, width):
    rowptr, col = small_csr(N, index_dtype=index_dtype)
    atol = 1e-5 if dtype == torch.float32 else 1e-12
    _compare(rowptr, col, *_inputs(N, width, dtype), reduce, atol)
    _compare(rowptr[5:17], col, *_inputs(11, width, dtype), reduce, atol)   # a row range: absolute offsets


def test_sigmoid_tails_and_gradcheck():
    """Gates at +-100 (the float kernel's exp is clamped there) and a float64 gradcheck."""
    rowptr, col = small_csr(N)
    _compare(rowptr, col, *_inputs(N, 24, torch.float32, scale=60.0), "sum", atol=1e-5)
    a, b, c = _inputs(N, 6, torch.float64)
    assert torch.autograd.gradcheck(lambda *t: ops.csr_gated_aggregate(rowptr, col, *t, "mean"), (a, b, c))


def test_fallback_and_errors(monkeypatch):
    rowptr, col = small_csr(N)
    monkeypatch.setattr(build, "_kernels", lambda kind: None)
    _compare(rowptr, col, *_inputs(N, 9, torch.float32), "mean", atol=1e-5)
    with pytest.raises(ValueError, match="reduce"):
        ops.csr_gated_aggregate(rowptr, col, *_inputs(N, 3, torch.float32), "max")


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_cuda_matches_reference(reduce):
    rowptr, col = small_csr(N)
    for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        a, b, c = _inputs(N, 37, dtype, device="cuda")
        out = ops.csr_gated_aggregate(rowptr.cuda(), col.cuda(), a, b, c, reduce)
        ref = reference(rowptr, col, a.detach().cpu(), b.detach().cpu(), c.detach().cpu(), reduce)
        torch.testing.assert_close(out.cpu(), ref, atol=atol, rtol=atol)
        grads = torch.autograd.grad(out, (a, b, c), torch.ones_like(out))
        ac, bc, cc = (t.detach().cpu().requires_grad_() for t in (a, b, c))
        want = torch.autograd.grad(reference(rowptr, col, ac, bc, cc, reduce), (ac, bc, cc),
                                   torch.ones(out.shape, dtype=dtype))
        for g, w in zip(grads, want):
            torch.testing.assert_close(g.cpu(), w, atol=atol, rtol=atol)
