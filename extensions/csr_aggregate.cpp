// Fused gather-aggregate over a CSR adjacency, CPU (OpenMP).
//
//   out[i, :] = REDUCE_{e in rowptr[i] .. rowptr[i+1]}  w[e] * x[col[e], :]       i = 0 .. R-1
//
// REDUCE is sum, mean (sum divided by the row's edge count) or max; w[e] = value[e], or 1 without
// values; rows without edges give 0 (the convention of PyG's scatter and torch.sparse.mm).
// `rowptr` holds R+1 *absolute* offsets into `col` / `value`: a destination row range of a bigger
// CSR is passed as the slice rowptr[row_start : row_end + 1] with the full col/value, no rebasing.
// `col` holds global source ids into x [N_src, d]. No [E, d] message tensor is ever built: each
// output row is accumulated in registers while the source rows are streamed in.
//
// Entry points (all take int32 or int64 indices and float32 or float64 features):
//   forward(rowptr, col, value?, x, reduce)          -> (out [R, d], arg [R, d] int32|int64 for max)
//   edge_dot(rowptr, col, x, g)                       -> [rowptr[R] - rowptr[0]]: <g[i], x[col[e]]>
//   max_backward(rowptr, col, value?, x, g, arg, n_src, need_x, need_value) -> (grad_x, grad_value)
//   transpose(rowptr, col, n_src)                     -> (tptr [n_src+1], trow, tedge)
//   gated_forward(rowptr, col, a, b, c, mean)       -> [R, d]: sum_e sigmoid(a[i] + b[col[e]]) * c[col[e]]
//   gated_backward(rowptr, col, tptr, trow, a, b, c, g, need_a, need_bc) -> (grad_a, grad_b, grad_c)
// The backward of sum/mean w.r.t. x is forward(sum) over the transposed structure (tptr, trow) with
// per-edge coefficients value[tedge] / deg[trow]; the Python side builds those and caches the
// transpose, so the backward is a row loop too (deterministic, no atomics).
//
// The gated Gather (NGra's G-GCN, PyG's ResGatedGraphConv) keeps the per-edge gate in registers too:
//   out[i, :] = scale_i * sum_e sigmoid(a[i, :] + b[j, :]) * c[j, :]         j = col[e], scale_i = 1 or 1/deg
// Its backward recomputes the gate s: grad_a[i] = sum_e g[i] c[j] s(1-s) in the row loop, and
// grad_b[j] = sum_e g[i] c[j] s(1-s), grad_c[j] = sum_e g[i] s in a loop over the transposed structure
// (tptr, trow); `g` arrives already multiplied by scale_i. Nothing of size [E, d] is stored.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

enum Reduce : int64_t { kSum = 0, kMean = 1, kMax = 2 };

constexpr int64_t kPrefetchDistance = 6;  // edges ahead whose source rows are prefetched

inline int num_threads() { return std::max(1, at::get_num_threads()); }

// Cut rows [0, R) into `parts` contiguous ranges of about equal work, work(row) = nnz(row) + 1
// (the +1 is the per-row cost of writing the output). Cumulative work up to row i is
// (rowptr[i] - rowptr[0]) + i, monotone in i, so each boundary is a binary search.
template <typename index_t>
std::vector<int64_t> balanced_bounds(const index_t* rowptr, int64_t rows, int64_t parts) {
  std::vector<int64_t> bounds(parts + 1);
  const int64_t base = rowptr[0];
  const int64_t total = (static_cast<int64_t>(rowptr[rows]) - base) + rows;
  bounds[0] = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t target = total * p / parts;
    int64_t lo = bounds[p - 1], hi = rows;  // first row i with work(i) >= target
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if ((static_cast<int64_t>(rowptr[mid]) - base) + mid < target) lo = mid + 1; else hi = mid;
    }
    bounds[p] = lo;
  }
  bounds[parts] = rows;
  return bounds;
}

// Run body(row_begin, row_end) over nnz-balanced row ranges on the OpenMP pool (dynamic schedule:
// a few ranges per thread, so one heavy row does not leave the other threads idle for long).
template <typename index_t, typename Body>
void parallel_rows(const index_t* rowptr, int64_t rows, int64_t width, const Body& body) {
  const int threads = num_threads();
  const int64_t work = (static_cast<int64_t>(rowptr[rows]) - rowptr[0] + rows) * std::max<int64_t>(width, 1);
  if (threads == 1 || rows < 2 || work < (1 << 15)) {
    body(int64_t(0), rows);
    return;
  }
  const int64_t parts = std::min<int64_t>(rows, int64_t(threads) * 16);
  const std::vector<int64_t> bounds = balanced_bounds(rowptr, rows, parts);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t p = 0; p < parts; ++p) body(bounds[p], bounds[p + 1]);
}

template <typename scalar_t>
inline void prefetch_row(const scalar_t* p, int64_t n) {
  // one prefetch per 64-byte line of the block about to be read
  constexpr int64_t per_line = 64 / sizeof(scalar_t);
  for (int64_t k = 0; k < n; k += per_line) __builtin_prefetch(p + k, 0, 3);
}

// ---- sum / mean: one output row, one block of B features kept in registers --------------------
template <typename scalar_t, typename index_t, bool WEIGHTED, int B>
inline void sum_block(const index_t* __restrict__ col, const scalar_t* __restrict__ val, int64_t e0,
                      int64_t e1, int64_t pf_end, const scalar_t* __restrict__ x, int64_t d, int64_t f0,
                      scalar_t scale, scalar_t* __restrict__ out) {
  scalar_t acc[B];
  for (int k = 0; k < B; ++k) acc[k] = scalar_t(0);
  for (int64_t e = e0; e < e1; ++e) {
    if (e + kPrefetchDistance < pf_end) prefetch_row(x + static_cast<int64_t>(col[e + kPrefetchDistance]) * d + f0, B);
    const scalar_t* __restrict__ xr = x + static_cast<int64_t>(col[e]) * d + f0;
    if (WEIGHTED) {
      const scalar_t w = val[e];
#pragma omp simd
      for (int k = 0; k < B; ++k) acc[k] += w * xr[k];
    } else {
#pragma omp simd
      for (int k = 0; k < B; ++k) acc[k] += xr[k];
    }
  }
#pragma omp simd
  for (int k = 0; k < B; ++k) out[f0 + k] = acc[k] * scale;
}

// features f0 .. f0+n-1 with a run-time n (< 8 for the tail of an odd width)
template <typename scalar_t, typename index_t, bool WEIGHTED>
inline void sum_tail(const index_t* __restrict__ col, const scalar_t* __restrict__ val, int64_t e0, int64_t e1,
                     const scalar_t* __restrict__ x, int64_t d, int64_t f0, int64_t n, scalar_t scale,
                     scalar_t* __restrict__ out) {
  for (int64_t k = 0; k < n; ++k) out[f0 + k] = scalar_t(0);
  for (int64_t e = e0; e < e1; ++e) {
    const scalar_t* __restrict__ xr = x + static_cast<int64_t>(col[e]) * d + f0;
    const scalar_t w = WEIGHTED ? val[e] : scalar_t(1);
    for (int64_t k = 0; k < n; ++k) out[f0 + k] += w * xr[k];
  }
  for (int64_t k = 0; k < n; ++k) out[f0 + k] *= scale;
}

// Blocks of 512 bytes (128 floats / 64 doubles) are the widest that stay in AVX-512 registers.
template <typename scalar_t, typename index_t, bool WEIGHTED>
inline void sum_row(const index_t* col, const scalar_t* val, int64_t e0, int64_t e1, int64_t pf_end,
                    const scalar_t* x, int64_t d, scalar_t scale, scalar_t* out) {
  constexpr int B0 = 512 / sizeof(scalar_t);
  int64_t f0 = 0;
  for (; f0 + B0 <= d; f0 += B0) sum_block<scalar_t, index_t, WEIGHTED, B0>(col, val, e0, e1, pf_end, x, d, f0, scale, out);
  if (f0 + B0 / 2 <= d) { sum_block<scalar_t, index_t, WEIGHTED, B0 / 2>(col, val, e0, e1, pf_end, x, d, f0, scale, out); f0 += B0 / 2; }
  if (f0 + B0 / 4 <= d) { sum_block<scalar_t, index_t, WEIGHTED, B0 / 4>(col, val, e0, e1, pf_end, x, d, f0, scale, out); f0 += B0 / 4; }
  if (f0 + B0 / 8 <= d) { sum_block<scalar_t, index_t, WEIGHTED, B0 / 8>(col, val, e0, e1, pf_end, x, d, f0, scale, out); f0 += B0 / 8; }
  if (f0 + 8 <= d) { sum_block<scalar_t, index_t, WEIGHTED, 8>(col, val, e0, e1, pf_end, x, d, f0, scale, out); f0 += 8; }
  if (f0 < d) sum_tail<scalar_t, index_t, WEIGHTED>(col, val, e0, e1, x, d, f0, d - f0, scale, out);
}

// ---- max: running maximum and the edge that produced it -------------------------------------
template <typename scalar_t, typename index_t, typename arg_t, bool WEIGHTED, int B>
inline void max_block(const index_t* __restrict__ col, const scalar_t* __restrict__ val, int64_t e0, int64_t e1,
                      int64_t pf_end, const scalar_t* __restrict__ x, int64_t d, int64_t f0,
                      scalar_t* __restrict__ out, arg_t* __restrict__ arg) {
  scalar_t acc[B];
  arg_t best[B];
  for (int k = 0; k < B; ++k) { acc[k] = -std::numeric_limits<scalar_t>::infinity(); best[k] = arg_t(-1); }
  for (int64_t e = e0; e < e1; ++e) {
    if (e + kPrefetchDistance < pf_end) prefetch_row(x + static_cast<int64_t>(col[e + kPrefetchDistance]) * d + f0, B);
    const scalar_t* __restrict__ xr = x + static_cast<int64_t>(col[e]) * d + f0;
    const scalar_t w = WEIGHTED ? val[e] : scalar_t(1);
    const arg_t ea = static_cast<arg_t>(e);
#pragma omp simd
    for (int k = 0; k < B; ++k) {
      const scalar_t v = WEIGHTED ? w * xr[k] : xr[k];
      const bool take = v > acc[k] || best[k] < 0;  // the first edge always counts (x may be -inf)
      acc[k] = take ? v : acc[k];
      best[k] = take ? ea : best[k];
    }
  }
  for (int k = 0; k < B; ++k) {
    out[f0 + k] = best[k] < 0 ? scalar_t(0) : acc[k];
    arg[f0 + k] = best[k];
  }
}

template <typename scalar_t, typename index_t, typename arg_t, bool WEIGHTED>
inline void max_row(const index_t* col, const scalar_t* val, int64_t e0, int64_t e1, int64_t pf_end,
                    const scalar_t* x, int64_t d, scalar_t* out, arg_t* arg) {
  // 512 bytes of features per pass, like sum, when the arg-max is int32 (values and args then fit
  // the 32 vector registers together; measured ~25% faster than 256-byte blocks at d=128, which
  // walk the row's edges twice); 256 bytes with int64 args.
  constexpr int B0 = (sizeof(arg_t) == 4 ? 512 : 256) / sizeof(scalar_t);
  int64_t f0 = 0;
  for (; f0 + B0 <= d; f0 += B0) max_block<scalar_t, index_t, arg_t, WEIGHTED, B0>(col, val, e0, e1, pf_end, x, d, f0, out, arg);
  if (f0 + B0 / 2 <= d) { max_block<scalar_t, index_t, arg_t, WEIGHTED, B0 / 2>(col, val, e0, e1, pf_end, x, d, f0, out, arg); f0 += B0 / 2; }
  if (f0 + B0 / 4 <= d) { max_block<scalar_t, index_t, arg_t, WEIGHTED, B0 / 4>(col, val, e0, e1, pf_end, x, d, f0, out, arg); f0 += B0 / 4; }
  if (B0 / 8 >= 8 && f0 + B0 / 8 <= d) { max_block<scalar_t, index_t, arg_t, WEIGHTED, (B0 / 8 >= 8 ? B0 / 8 : 8)>(col, val, e0, e1, pf_end, x, d, f0, out, arg); f0 += B0 / 8; }
  if (B0 / 16 >= 8 && f0 + B0 / 16 <= d) { max_block<scalar_t, index_t, arg_t, WEIGHTED, (B0 / 16 >= 8 ? B0 / 16 : 8)>(col, val, e0, e1, pf_end, x, d, f0, out, arg); f0 += B0 / 16; }
  for (; f0 < d; ++f0) max_block<scalar_t, index_t, arg_t, WEIGHTED, 1>(col, val, e0, e1, pf_end, x, d, f0, out, arg);
}

// ---- typed drivers ------------------------------------------------------------------------
template <typename scalar_t, typename index_t>
std::vector<torch::Tensor> forward_impl(const torch::Tensor& rowptr_t, const torch::Tensor& col_t,
                                        const c10::optional<torch::Tensor>& value_t, const torch::Tensor& x_t,
                                        int64_t reduce) {
  const int64_t rows = rowptr_t.numel() - 1, d = x_t.size(1);
  const index_t* rowptr = rowptr_t.data_ptr<index_t>();
  const index_t* col = col_t.data_ptr<index_t>();
  const scalar_t* val = value_t.has_value() ? value_t->data_ptr<scalar_t>() : nullptr;
  const scalar_t* x = x_t.data_ptr<scalar_t>();
  auto out_t = torch::empty({rows, d}, x_t.options());
  scalar_t* out = out_t.data_ptr<scalar_t>();
  if (reduce != kMax) {
    parallel_rows(rowptr, rows, d, [&](int64_t r0, int64_t r1) {
      const int64_t pf_end = rowptr[r1];  // prefetch across row ends: rows average ~20 edges
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t e0 = rowptr[i], e1 = rowptr[i + 1];
        const scalar_t scale = (reduce == kMean && e1 > e0) ? scalar_t(1) / scalar_t(e1 - e0) : scalar_t(1);
        if (val) sum_row<scalar_t, index_t, true>(col, val, e0, e1, pf_end, x, d, scale, out + i * d);
        else sum_row<scalar_t, index_t, false>(col, val, e0, e1, pf_end, x, d, scale, out + i * d);
      }
    });
    return {out_t};
  }
  // arg-max as an edge id; int32 when every edge id fits (half the memory of int64)
  const bool small = static_cast<int64_t>(rowptr[rows]) <= std::numeric_limits<int32_t>::max();
  auto arg_t = torch::empty({rows, d}, x_t.options().dtype(small ? torch::kInt32 : torch::kInt64));
  auto run = [&](auto* arg) {
    using A = std::remove_pointer_t<decltype(arg)>;
    parallel_rows(rowptr, rows, d, [&](int64_t r0, int64_t r1) {
      const int64_t pf_end = rowptr[r1];
      for (int64_t i = r0; i < r1; ++i) {
        if (val) max_row<scalar_t, index_t, A, true>(col, val, rowptr[i], rowptr[i + 1], pf_end, x, d, out + i * d, arg + i * d);
        else max_row<scalar_t, index_t, A, false>(col, val, rowptr[i], rowptr[i + 1], pf_end, x, d, out + i * d, arg + i * d);
      }
    });
  };
  if (small) run(arg_t.data_ptr<int32_t>()); else run(arg_t.data_ptr<int64_t>());
  return {out_t, arg_t};
}

template <typename scalar_t, typename index_t>
torch::Tensor edge_dot_impl(const torch::Tensor& rowptr_t, const torch::Tensor& col_t, const torch::Tensor& x_t,
                            const torch::Tensor& g_t) {
  const int64_t rows = rowptr_t.numel() - 1, d = x_t.size(1);
  const index_t* rowptr = rowptr_t.data_ptr<index_t>();
  const index_t* col = col_t.data_ptr<index_t>();
  const scalar_t* x = x_t.data_ptr<scalar_t>();
  const scalar_t* g = g_t.data_ptr<scalar_t>();
  const int64_t base = rows >= 0 ? static_cast<int64_t>(rowptr[0]) : 0;
  auto out_t = torch::empty({static_cast<int64_t>(rowptr[rows]) - base}, x_t.options());
  scalar_t* out = out_t.data_ptr<scalar_t>();
  parallel_rows(rowptr, rows, d, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const scalar_t* __restrict__ gr = g + i * d;
      for (int64_t e = rowptr[i]; e < rowptr[i + 1]; ++e) {
        if (e + kPrefetchDistance < rowptr[r1]) prefetch_row(x + static_cast<int64_t>(col[e + kPrefetchDistance]) * d, d);
        const scalar_t* __restrict__ xr = x + static_cast<int64_t>(col[e]) * d;
        scalar_t s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t k = 0; k < d; ++k) s += gr[k] * xr[k];
        out[e - base] = s;
      }
    }
  });
  return out_t;
}

template <typename scalar_t, typename index_t, typename arg_t>
void max_backward_impl(const torch::Tensor& rowptr_t, const torch::Tensor& col_t, const scalar_t* val,
                       const torch::Tensor& x_t, const torch::Tensor& g_t, const torch::Tensor& arg_tensor,
                       scalar_t* grad_x, scalar_t* grad_val, int64_t base) {
  const int64_t rows = rowptr_t.numel() - 1, d = g_t.size(1);
  const index_t* rowptr = rowptr_t.data_ptr<index_t>();
  const index_t* col = col_t.data_ptr<index_t>();
  const scalar_t* g = g_t.data_ptr<scalar_t>();
  const arg_t* arg = arg_tensor.data_ptr<arg_t>();
  if (grad_x) {
    // Several rows may scatter into one source row, so threads own disjoint column blocks of
    // grad_x (whole 64-byte lines), never the same element: no atomics, deterministic.
    constexpr int64_t line = 64 / sizeof(scalar_t);
    const int64_t blocks = (d + line - 1) / line;
    const int threads = static_cast<int>(std::min<int64_t>(num_threads(), blocks));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * d > (1 << 15))
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t f0 = b * line, f1 = std::min(d, f0 + line);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t f = f0; f < f1; ++f) {
          const int64_t e = arg[i * d + f];
          if (e < 0) continue;
          const scalar_t w = val ? val[e] : scalar_t(1);
          grad_x[static_cast<int64_t>(col[e]) * d + f] += w * g[i * d + f];
        }
      }
    }
  }
  if (grad_val) {
    // arg[i, :] only names edges of row i: rows are independent.
    const scalar_t* x = x_t.data_ptr<scalar_t>();
    parallel_rows(rowptr, rows, d, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t f = 0; f < d; ++f) {
          const int64_t e = arg[i * d + f];
          if (e >= 0) grad_val[e - base] += g[i * d + f] * x[static_cast<int64_t>(col[e]) * d + f];
        }
    });
  }
}

template <typename index_t>
std::vector<torch::Tensor> transpose_impl(const torch::Tensor& rowptr_t, const torch::Tensor& col_t, int64_t n_src) {
  const int64_t rows = rowptr_t.numel() - 1;
  const index_t* rowptr = rowptr_t.data_ptr<index_t>();
  const index_t* col = col_t.data_ptr<index_t>();
  const int64_t e0 = rowptr[0], e1 = rowptr[rows];
  auto opts = rowptr_t.options();
  auto tptr_t = torch::zeros({n_src + 1}, opts);
  auto trow_t = torch::empty({e1 - e0}, opts);
  auto tedge_t = torch::empty({e1 - e0}, opts);
  index_t* tptr = tptr_t.data_ptr<index_t>();
  index_t* trow = trow_t.data_ptr<index_t>();
  index_t* tedge = tedge_t.data_ptr<index_t>();
  // counting sort by source id; rows visited in order, so each source's edges stay sorted by row
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t s = col[e];
    TORCH_CHECK(s >= 0 && s < n_src, "csr_aggregate: col[", e, "] = ", s, " is outside [0, ", n_src, ")");
    ++tptr[s + 1];
  }
  for (int64_t s = 0; s < n_src; ++s) tptr[s + 1] += tptr[s];
  std::vector<index_t> fill(tptr, tptr + n_src);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t e = rowptr[i]; e < rowptr[i + 1]; ++e) {
      const index_t k = fill[col[e]]++;
      trow[k] = static_cast<index_t>(i);
      tedge[k] = static_cast<index_t>(e);
    }
  return {tptr_t, trow_t, tedge_t};
}

// ---- gated sum: NGra's G-GCN Gather without the [E, d] gate -------------------------------------
// exp for float that the compiler vectorizes inside `omp simd` loops (std::exp is a scalar call there):
// e^z = 2^n * e^r with n = round(z / ln 2), r = z - n ln 2 in [-ln2/2, ln2/2] (ln 2 in two parts, so r
// is exact), e^r by its degree-6 Taylor polynomial (truncation < 2e-9 relative, under float's 6e-8
// rounding), 2^n written into the exponent bits. z is clamped to [-87, 88], where 2^n is a normal float.
inline float exp_simd(float z) {
  z = std::min(88.0f, std::max(-87.0f, z));
  const float n = std::nearbyint(z * 1.44269504088896341f);
  const float r = (z - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline double exp_simd(double z) { return std::exp(z); }

template <typename scalar_t>
inline scalar_t sigmoid(scalar_t z) { return scalar_t(1) / (scalar_t(1) + exp_simd(-z)); }

template <typename scalar_t, typename index_t>
torch::Tensor gated_forward_impl(const torch::Tensor& rowptr_t, const torch::Tensor& col_t, const torch::Tensor& a_t,
                                 const torch::Tensor& b_t, const torch::Tensor& c_t, bool mean) {
  const int64_t rows = rowptr_t.numel() - 1, d = c_t.size(1);
  const index_t* rowptr = rowptr_t.data_ptr<index_t>();
  const index_t* col = col_t.data_ptr<index_t>();
  const scalar_t* a = a_t.data_ptr<scalar_t>();
  const scalar_t* b = b_t.data_ptr<scalar_t>();
  const scalar_t* c = c_t.data_ptr<scalar_t>();
  auto out_t = torch::zeros({rows, d}, c_t.options());
  scalar_t* out = out_t.data_ptr<scalar_t>();
  parallel_rows(rowptr, rows, 4 * d, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const scalar_t* __restrict__ ar = a + i * d;
      scalar_t* __restrict__ o = out + i * d;
      const int64_t e0 = rowptr[i], e1 = rowptr[i + 1];
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t j = col[e];
        const scalar_t* __restrict__ br = b + j * d;
        const scalar_t* __restrict__ cr = c + j * d;
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) o[k] += sigmoid(ar[k] + br[k]) * cr[k];
      }
      if (mean && e1 > e0) {
        const scalar_t s = scalar_t(1) / scalar_t(e1 - e0);
        for (int64_t k = 0; k < d; ++k) o[k] *= s;
      }
    }
  });
  return out_t;
}

template <typename scalar_t, typename index_t>
std::vector<torch::Tensor> gated_backward_impl(const torch::Tensor& rowptr_t, const torch::Tensor& col_t,
                                               const torch::Tensor& tptr_t, const torch::Tensor& trow_t,
                                               const torch::Tensor& a_t, const torch::Tensor& b_t,
                                               const torch::Tensor& c_t, const torch::Tensor& g_t, bool need_a,
                                               bool need_bc) {
  const int64_t rows = rowptr_t.numel() - 1, d = c_t.size(1), n_src = tptr_t.numel() - 1;
  const scalar_t* a = a_t.data_ptr<scalar_t>();
  const scalar_t* b = b_t.data_ptr<scalar_t>();
  const scalar_t* c = c_t.data_ptr<scalar_t>();
  const scalar_t* g = g_t.data_ptr<scalar_t>();
  torch::Tensor ga_t, gb_t, gc_t;
  if (need_a) {  // destination rows: the forward's row loop
    const index_t* rowptr = rowptr_t.data_ptr<index_t>();
    const index_t* col = col_t.data_ptr<index_t>();
    ga_t = torch::zeros({rows, d}, c_t.options());
    scalar_t* ga = ga_t.data_ptr<scalar_t>();
    parallel_rows(rowptr, rows, 4 * d, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        const scalar_t* __restrict__ ar = a + i * d;
        const scalar_t* __restrict__ gr = g + i * d;
        scalar_t* __restrict__ o = ga + i * d;
        for (int64_t e = rowptr[i]; e < rowptr[i + 1]; ++e) {
          const int64_t j = col[e];
          const scalar_t* __restrict__ br = b + j * d;
          const scalar_t* __restrict__ cr = c + j * d;
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) {
            const scalar_t s = sigmoid(ar[k] + br[k]);
            o[k] += gr[k] * cr[k] * s * (scalar_t(1) - s);
          }
        }
      }
    });
  }
  if (need_bc) {  // source rows: a loop over the transposed structure, so no two threads write one row
    const index_t* tptr = tptr_t.data_ptr<index_t>();
    const index_t* trow = trow_t.data_ptr<index_t>();
    gb_t = torch::zeros({n_src, d}, c_t.options());
    gc_t = torch::zeros({n_src, d}, c_t.options());
    scalar_t* gb = gb_t.data_ptr<scalar_t>();
    scalar_t* gc = gc_t.data_ptr<scalar_t>();
    parallel_rows(tptr, n_src, 4 * d, [&](int64_t s0, int64_t s1) {
      for (int64_t j = s0; j < s1; ++j) {
        const scalar_t* __restrict__ br = b + j * d;
        const scalar_t* __restrict__ cr = c + j * d;
        scalar_t* __restrict__ ob = gb + j * d;
        scalar_t* __restrict__ oc = gc + j * d;
        for (int64_t t = tptr[j]; t < tptr[j + 1]; ++t) {
          const int64_t i = trow[t];
          const scalar_t* __restrict__ ar = a + i * d;
          const scalar_t* __restrict__ gr = g + i * d;
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) {
            const scalar_t s = sigmoid(ar[k] + br[k]);
            oc[k] += gr[k] * s;
            ob[k] += gr[k] * cr[k] * s * (scalar_t(1) - s);
          }
        }
      }
    });
  }
  return {ga_t, gb_t, gc_t};
}

void check_common(const torch::Tensor& rowptr, const torch::Tensor& col, const torch::Tensor& x) {
  TORCH_CHECK(rowptr.device().is_cpu() && col.device().is_cpu() && x.device().is_cpu(),
              "csr_aggregate (C++): CPU tensors expected");
  TORCH_CHECK(rowptr.dim() == 1 && rowptr.numel() >= 1 && rowptr.is_contiguous(), "rowptr must be a contiguous 1-D tensor");
  TORCH_CHECK(col.dim() == 1 && col.is_contiguous(), "col must be a contiguous 1-D tensor");
  TORCH_CHECK(rowptr.scalar_type() == col.scalar_type(), "rowptr and col must have the same dtype");
  TORCH_CHECK(rowptr.scalar_type() == torch::kInt32 || rowptr.scalar_type() == torch::kInt64,
              "indices must be int32 or int64");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous 2-D tensor");
}

#define DISPATCH_INDEX(T, NAME, ...)                                         \
  [&] {                                                                      \
    if ((T) == torch::kInt32) { using index_t = int32_t; return __VA_ARGS__(); } \
    else { using index_t = int64_t; return __VA_ARGS__(); }                  \
  }()

std::vector<torch::Tensor> forward(torch::Tensor rowptr, torch::Tensor col, c10::optional<torch::Tensor> value,
                                   torch::Tensor x, int64_t reduce) {
  check_common(rowptr, col, x);
  TORCH_CHECK(reduce == kSum || reduce == kMean || reduce == kMax, "reduce code must be 0, 1 or 2");
  if (value.has_value())
    TORCH_CHECK(value->dtype() == x.dtype() && value->is_contiguous() && value->numel() >= col.numel(),
                "value must be contiguous, as long as col and of x's dtype");
  std::vector<torch::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "csr_aggregate_forward", [&] {
    DISPATCH_INDEX(rowptr.scalar_type(), "index", [&] { result = forward_impl<scalar_t, index_t>(rowptr, col, value, x, reduce); });
  });
  return result;
}

torch::Tensor edge_dot(torch::Tensor rowptr, torch::Tensor col, torch::Tensor x, torch::Tensor g) {
  check_common(rowptr, col, x);
  TORCH_CHECK(g.dim() == 2 && g.is_contiguous() && g.size(0) == rowptr.numel() - 1 && g.size(1) == x.size(1) &&
                  g.dtype() == x.dtype(), "g must be a contiguous [R, d] tensor of x's dtype");
  torch::Tensor result;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "csr_aggregate_edge_dot", [&] {
    DISPATCH_INDEX(rowptr.scalar_type(), "index", [&] { result = edge_dot_impl<scalar_t, index_t>(rowptr, col, x, g); });
  });
  return result;
}

// grad_value is returned for the edges rowptr[0] .. rowptr[R] only (the Python side places it).
std::vector<torch::Tensor> max_backward(torch::Tensor rowptr, torch::Tensor col, c10::optional<torch::Tensor> value,
                                        torch::Tensor x, torch::Tensor g, torch::Tensor arg, int64_t n_src,
                                        bool need_x, bool need_value) {
  check_common(rowptr, col, x);
  TORCH_CHECK(g.is_contiguous() && arg.is_contiguous() && g.sizes() == arg.sizes(), "g and arg must match");
  const int64_t rows = rowptr.numel() - 1, d = g.size(1);
  torch::Tensor gx, gv;
  if (need_x) gx = torch::zeros({n_src, d}, g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "csr_aggregate_max_backward", [&] {
    DISPATCH_INDEX(rowptr.scalar_type(), "index", [&] {
      const int64_t base = rowptr.data_ptr<index_t>()[0];
      if (need_value) gv = torch::zeros({static_cast<int64_t>(rowptr.data_ptr<index_t>()[rows]) - base}, g.options());
      const scalar_t* val = value.has_value() ? value->data_ptr<scalar_t>() : nullptr;
      scalar_t* gxp = need_x ? gx.data_ptr<scalar_t>() : nullptr;
      scalar_t* gvp = need_value ? gv.data_ptr<scalar_t>() : nullptr;
      if (arg.scalar_type() == torch::kInt32)
        max_backward_impl<scalar_t, index_t, int32_t>(rowptr, col, val, x, g, arg, gxp, gvp, base);
      else
        max_backward_impl<scalar_t, index_t, int64_t>(rowptr, col, val, x, g, arg, gxp, gvp, base);
    });
  });
  (void)d;
  return {gx, gv};
}

std::vector<torch::Tensor> transpose(torch::Tensor rowptr, torch::Tensor col, int64_t n_src) {
  TORCH_CHECK(rowptr.device().is_cpu() && rowptr.is_contiguous() && col.is_contiguous() &&
                  rowptr.scalar_type() == col.scalar_type(), "transpose: contiguous CPU rowptr/col of one dtype");
  std::vector<torch::Tensor> result;
  DISPATCH_INDEX(rowptr.scalar_type(), "index", [&] { result = transpose_impl<index_t>(rowptr, col, n_src); });
  return result;
}

void check_gated(const torch::Tensor& rowptr, const torch::Tensor& col, const torch::Tensor& a,
                 const torch::Tensor& b, const torch::Tensor& c) {
  check_common(rowptr, col, c);
  for (const torch::Tensor* t : {&a, &b})
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->size(1) == c.size(1) && t->dtype() == c.dtype() &&
                    t->device().is_cpu(), "gated: a, b, c must be contiguous 2-D CPU tensors of one width and dtype");
  TORCH_CHECK(a.size(0) == rowptr.numel() - 1, "gated: a needs one row per destination row");
  TORCH_CHECK(b.size(0) == c.size(0), "gated: b and c need one row per source");
}

torch::Tensor gated_forward(torch::Tensor rowptr, torch::Tensor col, torch::Tensor a, torch::Tensor b,
                            torch::Tensor c, bool mean) {
  check_gated(rowptr, col, a, b, c);
  torch::Tensor result;
  AT_DISPATCH_FLOATING_TYPES(c.scalar_type(), "csr_gated_forward", [&] {
    DISPATCH_INDEX(rowptr.scalar_type(), "index", [&] { result = gated_forward_impl<scalar_t, index_t>(rowptr, col, a, b, c, mean); });
  });
  return result;
}

std::vector<torch::Tensor> gated_backward(torch::Tensor rowptr, torch::Tensor col, torch::Tensor tptr,
                                          torch::Tensor trow, torch::Tensor a, torch::Tensor b, torch::Tensor c,
                                          torch::Tensor g, bool need_a, bool need_bc) {
  check_gated(rowptr, col, a, b, c);
  TORCH_CHECK(g.sizes() == a.sizes() && g.is_contiguous() && g.dtype() == c.dtype(), "gated: g must be like a");
  TORCH_CHECK(tptr.scalar_type() == rowptr.scalar_type() && trow.scalar_type() == rowptr.scalar_type() &&
                  tptr.numel() == b.size(0) + 1 && tptr.is_contiguous() && trow.is_contiguous(),
              "gated: tptr [n_src + 1] and trow of rowptr's dtype");
  std::vector<torch::Tensor> result;
  AT_DISPATCH_FLOATING_TYPES(c.scalar_type(), "csr_gated_backward", [&] {
    DISPATCH_INDEX(rowptr.scalar_type(), "index", [&] {
      result = gated_backward_impl<scalar_t, index_t>(rowptr, col, tptr, trow, a, b, c, g, need_a, need_bc);
    });
  });
  return result;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyg_pipe fused CSR gather-aggregate kernels (CPU, OpenMP)";
  m.def("forward", &forward, "CSR aggregate forward: (out, arg)");
  m.def("edge_dot", &edge_dot, "per-edge <g[row], x[col]>");
  m.def("max_backward", &max_backward, "max aggregate backward through the arg-max");
  m.def("transpose", &transpose, "CSR -> transposed (tptr, trow, tedge) by counting sort");
  m.def("gated_forward", &gated_forward, "gated CSR sum: sum_e sigmoid(a[i] + b[j]) * c[j]");
  m.def("gated_backward", &gated_backward, "gradients of gated_forward (grad_a, grad_b, grad_c)");
  m.def("num_threads", &num_threads, "threads the kernels use");
}
