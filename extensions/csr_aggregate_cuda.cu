// Fused gather-aggregate over a CSR adjacency, CUDA. Same contract as csr_aggregate.cpp:
//
//   out[i, :] = REDUCE_{e in rowptr[i] .. rowptr[i+1]}  w[e] * x[col[e], :]       i = 0 .. R-1
//
// (REDUCE = sum / mean / max, w = value or 1, empty rows give 0, rowptr holds absolute offsets so a
// row-range slice of a bigger CSR works unchanged, col holds global source ids into x [N_src, d]).
//
// Layout: a group of G lanes of one warp owns one destination row; each lane owns V consecutive
// features (one 16-byte vector load: 4 floats or 2 doubles) and walks the row's edges, accumulating
// in registers; G is the smallest power of two covering d / V (at most 32), so narrow features pack
// several rows into a warp. No [E, d] buffer. The source-row reads are coalesced per edge (G * V
// consecutive features of one row).
//
// Entry points:
//   forward(rowptr, col, value?, x, reduce)  -> (out, arg)   arg: int32/int64 edge id per (row, feature), max only
//   edge_dot(rowptr, col, x, g)              -> per-edge <g[i], x[col[e]]> for edges rowptr[0]..rowptr[R]
//   max_backward(rowptr, col, value?, x, g, arg, n_src, need_x, need_value) -> (grad_x, grad_value)
// The sum/mean backward w.r.t. x is forward(sum) over the transposed adjacency (built by the Python
// side with a stable sort and cached), so it needs no atomics and is deterministic. max_backward
// scatters through the arg-max with atomicAdd: several rows can share a source row, so its grad_x is
// not bitwise deterministic (the sums are the same up to rounding order).
//
// The gated Gather of NGra's G-GCN (same contract as the CPU file):
//   gated_forward(rowptr, col, a, b, c, mean)  -> [R, d]: scale_i * sum_e sigmoid(a[i] + b[j]) * c[j]
//   gated_backward(rowptr, col, tptr, trow, a, b, c, g, need_a, need_bc) -> (grad_a, grad_b, grad_c)
// One thread per (row, feature), consecutive threads on consecutive features of one row (coalesced),
// the gate recomputed in the backward; grad_b/grad_c loop over the transposed structure (no atomics).
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>

namespace {

constexpr int kThreads = 256;

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

__host__ __device__ inline int lanes_for(int64_t d, int v) {
  int64_t need = (d + v - 1) / v;
  int g = 1;
  while (g < 32 && g < need) g <<= 1;
  return g;
}

template <typename T, int V>
__device__ inline Vec<T, V> load_vec(const T* p) {
  if (V == 1) {
    Vec<T, V> r;
    r.v[0] = __ldg(p);
    return r;
  }
  return *reinterpret_cast<const Vec<T, V>*>(p);
}

// ---- forward: sum / mean ------------------------------------------------------------------
template <typename scalar_t, typename index_t, int V, bool WEIGHTED>
__global__ void sum_kernel(const index_t* __restrict__ rowptr, const index_t* __restrict__ col,
                           const scalar_t* __restrict__ val, const scalar_t* __restrict__ x,
                           scalar_t* __restrict__ out, int64_t rows, int64_t d, int G, bool mean) {
  const int64_t gid = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  const int64_t row = gid / G;
  const int lane = static_cast<int>(gid % G);
  if (row >= rows) return;
  const int64_t e0 = rowptr[row], e1 = rowptr[row + 1];
  const scalar_t scale = (mean && e1 > e0) ? scalar_t(1) / scalar_t(e1 - e0) : scalar_t(1);
  for (int64_t f = static_cast<int64_t>(lane) * V; f < d; f += static_cast<int64_t>(G) * V) {
    scalar_t acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = scalar_t(0);
    for (int64_t e = e0; e < e1; ++e) {
      const Vec<scalar_t, V> xv = load_vec<scalar_t, V>(x + static_cast<int64_t>(col[e]) * d + f);
      const scalar_t w = WEIGHTED ? val[e] : scalar_t(1);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += w * xv.v[k];
    }
    Vec<scalar_t, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = acc[k] * scale;
    *reinterpret_cast<Vec<scalar_t, V>*>(out + row * d + f) = o;
  }
}

// ---- forward: sum / mean, edge-balanced (long rows split across groups) ----------------------
// The row kernel above gives a whole row to one group: on a power-law graph a hub row of 10^5 edges
// runs on 32 lanes while the rest of the GPU idles (measured on an H200: 9x slower than cuSPARSE on a
// power-law graph, 2x faster on a uniform one). Here the edges rowptr[0] .. rowptr[R] are cut into
// slices of S consecutive edges and each group walks one slice (merge-path style), so every group does
// the same work whatever the degrees:
//   pass 1: a row that starts in the slice is written to out (its part in this slice); the part of the
//           row the slice starts inside of (begun in an earlier slice) goes to carry[slice]; the slice
//           whose last row runs on past its end records that row in fix[slice];
//   pass 2: for each recorded row, out[row] += carry[k+1] + carry[k+2] + ... in slice order.
// No atomics: the result does not depend on scheduling (deterministic), and nothing of size |E| x d
// is built (carry is ceil(E / S) x d). Rows without edges stay 0 (out starts zeroed). The slice count
// comes from col.numel() (an upper bound for a row-range slice of a bigger CSR, whose surplus groups
// exit at once), so the host never reads rowptr: no host sync.
template <typename index_t>
__device__ inline int64_t row_of_edge(const index_t* __restrict__ rowptr, int64_t rows, int64_t e) {
  // the row r with rowptr[r] <= e < rowptr[r + 1] (the last such r: empty rows are skipped)
  int64_t lo = 0, hi = rows;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(rowptr[mid]) <= e) lo = mid; else hi = mid;
  }
  return lo;
}

template <typename scalar_t, typename index_t, int V, bool WEIGHTED>
__global__ void sum_split_kernel(const index_t* __restrict__ rowptr, const index_t* __restrict__ col,
                                 const scalar_t* __restrict__ val, const scalar_t* __restrict__ x,
                                 scalar_t* __restrict__ out, scalar_t* __restrict__ carry, int64_t* __restrict__ fix,
                                 int64_t rows, int64_t d, int G, int64_t S, int64_t slices, bool mean) {
  const int64_t gid = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  const int64_t k = gid / G;
  const int lane = static_cast<int>(gid % G);
  if (k >= slices) return;
  const int64_t base = rowptr[0], end = rowptr[rows];
  const int64_t lo = base + k * S;
  if (lo >= end) return;
  const int64_t hi = min(lo + S, end);
  const int64_t first = row_of_edge(rowptr, rows, lo);
  int64_t last_open = -1;  // a row begun in this slice that runs on past hi
  for (int64_t f = static_cast<int64_t>(lane) * V; f < d; f += static_cast<int64_t>(G) * V) {
    int64_t row = first, e = lo;
    while (e < hi) {
      const int64_t r0 = rowptr[row], r1 = rowptr[row + 1];
      const int64_t stop = min(r1, hi);
      scalar_t acc[V];
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] = scalar_t(0);
      for (; e < stop; ++e) {
        const Vec<scalar_t, V> xv = load_vec<scalar_t, V>(x + static_cast<int64_t>(col[e]) * d + f);
        const scalar_t w = WEIGHTED ? val[e] : scalar_t(1);
#pragma unroll
        for (int q = 0; q < V; ++q) acc[q] += w * xv.v[q];
      }
      const scalar_t scale = mean ? scalar_t(1) / scalar_t(r1 - r0) : scalar_t(1);
      Vec<scalar_t, V> o;
#pragma unroll
      for (int q = 0; q < V; ++q) o.v[q] = acc[q] * scale;
      scalar_t* dst = (r0 < lo) ? carry + k * d + f : out + row * d + f;
      *reinterpret_cast<Vec<scalar_t, V>*>(dst) = o;
      if (r0 >= lo && r1 > hi) last_open = row;
      ++row;
      while (row < rows && static_cast<int64_t>(rowptr[row + 1]) <= e) ++row;  // skip empty rows
    }
  }
  if (lane == 0) fix[k] = last_open;
}

template <typename scalar_t, typename index_t, int V>
__global__ void sum_split_fix_kernel(const index_t* __restrict__ rowptr, const scalar_t* __restrict__ carry,
                                     const int64_t* __restrict__ fix, scalar_t* __restrict__ out,
                                     int64_t rows, int64_t d, int G, int64_t S, int64_t slices) {
  const int64_t gid = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  const int64_t k = gid / G;
  const int lane = static_cast<int>(gid % G);
  if (k >= slices) return;
  const int64_t base = rowptr[0], end = rowptr[rows];
  if (base + k * S >= end) return;
  const int64_t row = fix[k];
  if (row < 0) return;
  const int64_t r1 = rowptr[row + 1];
  for (int64_t f = static_cast<int64_t>(lane) * V; f < d; f += static_cast<int64_t>(G) * V) {
    Vec<scalar_t, V> acc = *reinterpret_cast<const Vec<scalar_t, V>*>(out + row * d + f);
    for (int64_t j = k + 1; j < slices && base + j * S < r1; ++j) {
      const Vec<scalar_t, V> c = *reinterpret_cast<const Vec<scalar_t, V>*>(carry + j * d + f);
#pragma unroll
      for (int q = 0; q < V; ++q) acc.v[q] += c.v[q];
    }
    *reinterpret_cast<Vec<scalar_t, V>*>(out + row * d + f) = acc;
  }
}

// ---- forward: max with arg-max -------------------------------------------------------------
template <typename scalar_t, typename index_t, typename arg_t, int V, bool WEIGHTED>
__global__ void max_kernel(const index_t* __restrict__ rowptr, const index_t* __restrict__ col,
                           const scalar_t* __restrict__ val, const scalar_t* __restrict__ x,
                           scalar_t* __restrict__ out, arg_t* __restrict__ arg, int64_t rows, int64_t d, int G) {
  const int64_t gid = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  const int64_t row = gid / G;
  const int lane = static_cast<int>(gid % G);
  if (row >= rows) return;
  const int64_t e0 = rowptr[row], e1 = rowptr[row + 1];
  for (int64_t f = static_cast<int64_t>(lane) * V; f < d; f += static_cast<int64_t>(G) * V) {
    scalar_t acc[V];
    arg_t best[V];
#pragma unroll
    for (int k = 0; k < V; ++k) { acc[k] = scalar_t(0); best[k] = arg_t(-1); }
    for (int64_t e = e0; e < e1; ++e) {
      const Vec<scalar_t, V> xv = load_vec<scalar_t, V>(x + static_cast<int64_t>(col[e]) * d + f);
      const scalar_t w = WEIGHTED ? val[e] : scalar_t(1);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const scalar_t v = WEIGHTED ? w * xv.v[k] : xv.v[k];
        if (best[k] < 0 || v > acc[k]) { acc[k] = v; best[k] = static_cast<arg_t>(e); }
      }
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
      out[row * d + f + k] = acc[k];
      arg[row * d + f + k] = best[k];
    }
  }
}

// ---- per-edge dot product (gradient w.r.t. the edge values) --------------------------------
template <typename scalar_t, typename index_t, int V>
__global__ void edge_dot_kernel(const index_t* __restrict__ rowptr, const index_t* __restrict__ col,
                                const scalar_t* __restrict__ x, const scalar_t* __restrict__ g,
                                scalar_t* __restrict__ out, int64_t rows, int64_t d, int G, int64_t base) {
  const int64_t gid = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x);
  const int64_t row = gid / G;
  const int lane = static_cast<int>(gid % G);
  // whole groups leave together (rows is uniform within a group), so the shuffles below are safe
  if (row >= rows) return;
  const int64_t e0 = rowptr[row], e1 = rowptr[row + 1];
  const unsigned group_mask = (G == 32) ? 0xffffffffu
                                        : (((1u << G) - 1u) << ((threadIdx.x % 32) / G * G));
  for (int64_t e = e0; e < e1; ++e) {
    const scalar_t* xr = x + static_cast<int64_t>(col[e]) * d;
    scalar_t s = 0;
    for (int64_t f = static_cast<int64_t>(lane) * V; f < d; f += static_cast<int64_t>(G) * V) {
      const Vec<scalar_t, V> xv = load_vec<scalar_t, V>(xr + f);
      const Vec<scalar_t, V> gv = load_vec<scalar_t, V>(g + row * d + f);
#pragma unroll
      for (int k = 0; k < V; ++k) s += xv.v[k] * gv.v[k];
    }
    for (int off = G / 2; off > 0; off >>= 1) s += __shfl_xor_sync(group_mask, s, off, G);
    if (lane == 0) out[e - base] = s;
  }
}

// ---- max backward through the arg-max (atomics) --------------------------------------------
template <typename scalar_t, typename index_t, typename arg_t>
__global__ void max_backward_kernel(const index_t* __restrict__ col, const scalar_t* __restrict__ val,
                                    const scalar_t* __restrict__ x, const scalar_t* __restrict__ g,
                                    const arg_t* __restrict__ arg, scalar_t* __restrict__ gx,
                                    scalar_t* __restrict__ gv, int64_t n, int64_t d, int64_t base) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n) return;
  const int64_t e = arg[idx];
  if (e < 0) return;
  const int64_t f = idx % d;
  const int64_t src = col[e];
  if (gx) atomicAdd(gx + src * d + f, (val ? val[e] : scalar_t(1)) * g[idx]);
  if (gv) atomicAdd(gv + (e - base), g[idx] * x[src * d + f]);
}

// ---- gated Gather (G-GCN) ------------------------------------------------------------------
template <typename scalar_t>
__device__ inline scalar_t sigmoid_dev(scalar_t z) { return scalar_t(1) / (scalar_t(1) + exp(-z)); }

template <typename scalar_t, typename index_t>
__global__ void gated_rows_kernel(const index_t* __restrict__ rowptr, const index_t* __restrict__ col,
                                  const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                  const scalar_t* __restrict__ c, const scalar_t* __restrict__ g,
                                  scalar_t* __restrict__ out, int64_t rows, int64_t d, bool mean) {
  // g == nullptr: forward (out = gated sum); else grad_a (out = sum g c s (1 - s))
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * d) return;
  const int64_t i = idx / d, f = idx % d;
  const int64_t e0 = rowptr[i], e1 = rowptr[i + 1];
  const scalar_t ai = a[idx];
  const scalar_t gi = g ? g[idx] : scalar_t(0);
  scalar_t acc = 0;
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t j = static_cast<int64_t>(col[e]) * d + f;
    const scalar_t s = sigmoid_dev(ai + b[j]);
    acc += g ? gi * c[j] * s * (scalar_t(1) - s) : s * c[j];
  }
  out[idx] = (mean && e1 > e0) ? acc / scalar_t(e1 - e0) : acc;
}

template <typename scalar_t, typename index_t>
__global__ void gated_sources_kernel(const index_t* __restrict__ tptr, const index_t* __restrict__ trow,
                                     const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                     const scalar_t* __restrict__ c, const scalar_t* __restrict__ g,
                                     scalar_t* __restrict__ gb, scalar_t* __restrict__ gc, int64_t n_src, int64_t d) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_src * d) return;
  const int64_t j = idx / d, f = idx % d;
  const scalar_t bj = b[idx], cj = c[idx];
  scalar_t accb = 0, accc = 0;
  for (int64_t t = tptr[j]; t < tptr[j + 1]; ++t) {
    const int64_t i = static_cast<int64_t>(trow[t]) * d + f;
    const scalar_t s = sigmoid_dev(a[i] + bj);
    accc += g[i] * s;
    accb += g[i] * cj * s * (scalar_t(1) - s);
  }
  gb[idx] = accb;
  gc[idx] = accc;
}

// ---- host side -------------------------------------------------------------------------
void check_common(const torch::Tensor& rowptr, const torch::Tensor& col, const torch::Tensor& x) {
  TORCH_CHECK(rowptr.is_cuda() && col.is_cuda() && x.is_cuda(), "csr_aggregate (CUDA): CUDA tensors expected");
  TORCH_CHECK(rowptr.device() == x.device() && col.device() == x.device(), "all tensors on one device");
  TORCH_CHECK(rowptr.dim() == 1 && rowptr.numel() >= 1 && rowptr.is_contiguous(), "rowptr: contiguous 1-D");
  TORCH_CHECK(col.dim() == 1 && col.is_contiguous(), "col: contiguous 1-D");
  TORCH_CHECK(rowptr.scalar_type() == col.scalar_type() &&
                  (rowptr.scalar_type() == torch::kInt32 || rowptr.scalar_type() == torch::kInt64),
              "rowptr and col: one dtype, int32 or int64");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous 2-D");
}

template <typename scalar_t>
int vec_width(const torch::Tensor& x, std::initializer_list<const torch::Tensor*> others) {
  constexpr int V = 16 / sizeof(scalar_t);
  const int64_t d = x.size(1);
  if (d % V != 0) return 1;
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return 1;
  for (const torch::Tensor* t : others)
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return 1;
  return V;
}

// Edges per slice of the edge-balanced sum/mean kernel; 0 = the row kernel (one group per row).
// Set from Python (PYG_PIPE_CUDA_SLICE_EDGES) through set_slice_edges.
int64_t g_slice_edges = 256;

inline unsigned blocks_for(int64_t threads_total) {
  return static_cast<unsigned>((threads_total + kThreads - 1) / kThreads);
}

#define DISPATCH_INDEX(T, ...)                                                       \
  [&] {                                                                              \
    if ((T) == torch::kInt32) { using index_t = int32_t; return __VA_ARGS__(); }     \
    else { using index_t = int64_t; return __VA_ARGS__(); }                          \
  }()

#define DISPATCH_VEC(VW, ...)                                                        \
  [&] {                                                                              \
    if ((VW) == 1) { constexpr int V = 1; return __VA_ARGS__(); }                    \
    else { constexpr int V = 16 / sizeof(scalar_t); return __VA_ARGS__(); }          \
  }()

std::vector<torch::Tensor> forward(torch::Tensor rowptr, torch::Tensor col, c10::optional<torch::Tensor> value,
                                   torch::Tensor x, int64_t reduce) {
  check_common(rowptr, col, x);
  TORCH_CHECK(reduce >= 0 && reduce <= 2, "reduce code must be 0 (sum), 1 (mean) or 2 (max)");
  if (value.has_value())
    TORCH_CHECK(value->is_cuda() && value->dtype() == x.dtype() && value->is_contiguous(),
                "value: contiguous, on x's device, of x's dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = rowptr.numel() - 1, d = x.size(1);
  const int64_t S = g_slice_edges;
  const bool split = reduce != 2 && S > 0;
  auto out = split ? torch::zeros({rows, d}, x.options()) : torch::empty({rows, d}, x.options());
  torch::Tensor arg;
  if (rows == 0 || d == 0 || (split && col.numel() == 0)) {
    if (reduce == 2) arg = torch::empty({rows, d}, x.options().dtype(torch::kInt64));
    return {out, arg};
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "csr_aggregate_cuda_forward", [&] {
    const int vw = vec_width<scalar_t>(x, {&out});
    const int G = lanes_for(d, vw);
    const unsigned blocks = blocks_for(rows * G);
    const scalar_t* val = value.has_value() ? value->data_ptr<scalar_t>() : nullptr;
    DISPATCH_INDEX(rowptr.scalar_type(), [&] {
      DISPATCH_VEC(vw, [&] {
        const index_t* rp = rowptr.data_ptr<index_t>();
        const index_t* c = col.data_ptr<index_t>();
        if (split) {
          const int64_t slices = (col.numel() + S - 1) / S;
          auto carry = torch::empty({slices, d}, x.options());
          auto fix = torch::empty({slices}, x.options().dtype(torch::kInt64));
          const unsigned sblocks = blocks_for(slices * G);
          if (val)
            sum_split_kernel<scalar_t, index_t, V, true><<<sblocks, kThreads, 0, stream>>>(
                rp, c, val, x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), carry.data_ptr<scalar_t>(),
                fix.data_ptr<int64_t>(), rows, d, G, S, slices, reduce == 1);
          else
            sum_split_kernel<scalar_t, index_t, V, false><<<sblocks, kThreads, 0, stream>>>(
                rp, c, val, x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), carry.data_ptr<scalar_t>(),
                fix.data_ptr<int64_t>(), rows, d, G, S, slices, reduce == 1);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          sum_split_fix_kernel<scalar_t, index_t, V><<<sblocks, kThreads, 0, stream>>>(
              rp, carry.data_ptr<scalar_t>(), fix.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), rows, d, G, S,
              slices);
        } else if (reduce != 2) {
          if (val)
            sum_kernel<scalar_t, index_t, V, true><<<blocks, kThreads, 0, stream>>>(
                rp, c, val, x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, d, G, reduce == 1);
          else
            sum_kernel<scalar_t, index_t, V, false><<<blocks, kThreads, 0, stream>>>(
                rp, c, val, x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, d, G, reduce == 1);
        } else {
          // edge ids of the arg-max: int32 when they fit (the size of a float32 output)
          const int64_t nnz_end = rowptr[rows].item<int64_t>();
          const bool small = nnz_end <= std::numeric_limits<int32_t>::max();
          arg = torch::empty({rows, d}, x.options().dtype(small ? torch::kInt32 : torch::kInt64));
          auto launch = [&](auto* a) {
            using A = std::remove_pointer_t<decltype(a)>;
            if (val)
              max_kernel<scalar_t, index_t, A, V, true><<<blocks, kThreads, 0, stream>>>(
                  rp, c, val, x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), a, rows, d, G);
            else
              max_kernel<scalar_t, index_t, A, V, false><<<blocks, kThreads, 0, stream>>>(
                  rp, c, val, x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), a, rows, d, G);
          };
          if (small) launch(arg.data_ptr<int32_t>()); else launch(arg.data_ptr<int64_t>());
        }
      });
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, arg};
}

torch::Tensor edge_dot(torch::Tensor rowptr, torch::Tensor col, torch::Tensor x, torch::Tensor g) {
  check_common(rowptr, col, x);
  TORCH_CHECK(g.is_cuda() && g.is_contiguous() && g.dim() == 2 && g.size(0) == rowptr.numel() - 1 &&
                  g.size(1) == x.size(1) && g.dtype() == x.dtype(), "g: contiguous [R, d] of x's dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = rowptr.numel() - 1, d = x.size(1);
  const int64_t base = rowptr[0].item<int64_t>(), end = rowptr[rows].item<int64_t>();
  auto out = torch::zeros({end - base}, x.options());
  if (rows == 0 || d == 0 || end == base) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "csr_aggregate_cuda_edge_dot", [&] {
    const int vw = vec_width<scalar_t>(x, {&g});
    const int G = lanes_for(d, vw);
    DISPATCH_INDEX(rowptr.scalar_type(), [&] {
      DISPATCH_VEC(vw, [&] {
        edge_dot_kernel<scalar_t, index_t, V><<<blocks_for(rows * G), kThreads, 0, stream>>>(
            rowptr.data_ptr<index_t>(), col.data_ptr<index_t>(), x.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(),
            out.data_ptr<scalar_t>(), rows, d, G, base);
      });
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::vector<torch::Tensor> max_backward(torch::Tensor rowptr, torch::Tensor col, c10::optional<torch::Tensor> value,
                                        torch::Tensor x, torch::Tensor g, torch::Tensor arg, int64_t n_src,
                                        bool need_x, bool need_value) {
  check_common(rowptr, col, x);
  TORCH_CHECK(g.is_contiguous() && arg.is_contiguous() && g.sizes() == arg.sizes(), "g and arg must match");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = rowptr.numel() - 1, d = g.size(1);
  const int64_t base = rowptr[0].item<int64_t>(), end = rowptr[rows].item<int64_t>();
  torch::Tensor gx, gv;
  if (need_x) gx = torch::zeros({n_src, d}, g.options());
  if (need_value) gv = torch::zeros({end - base}, g.options());
  const int64_t n = rows * d;
  if (n == 0) return {gx, gv};
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "csr_aggregate_cuda_max_backward", [&] {
    const scalar_t* val = value.has_value() ? value->data_ptr<scalar_t>() : nullptr;
    scalar_t* gxp = need_x ? gx.data_ptr<scalar_t>() : nullptr;
    scalar_t* gvp = need_value ? gv.data_ptr<scalar_t>() : nullptr;
    DISPATCH_INDEX(rowptr.scalar_type(), [&] {
      const index_t* c = col.data_ptr<index_t>();
      if (arg.scalar_type() == torch::kInt32)
        max_backward_kernel<scalar_t, index_t, int32_t><<<blocks_for(n), kThreads, 0, stream>>>(
            c, val, x.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), arg.data_ptr<int32_t>(), gxp, gvp, n, d, base);
      else
        max_backward_kernel<scalar_t, index_t, int64_t><<<blocks_for(n), kThreads, 0, stream>>>(
            c, val, x.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), arg.data_ptr<int64_t>(), gxp, gvp, n, d, base);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {gx, gv};
}

void check_gated(const torch::Tensor& rowptr, const torch::Tensor& col, const torch::Tensor& a,
                 const torch::Tensor& b, const torch::Tensor& c) {
  check_common(rowptr, col, c);
  for (const torch::Tensor* t : {&a, &b})
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->size(1) == c.size(1) && t->dtype() == c.dtype() &&
                    t->device() == c.device(), "gated: a, b, c must be contiguous 2-D tensors of one width, dtype, device");
  TORCH_CHECK(a.size(0) == rowptr.numel() - 1, "gated: a needs one row per destination row");
  TORCH_CHECK(b.size(0) == c.size(0), "gated: b and c need one row per source");
}

torch::Tensor gated_forward(torch::Tensor rowptr, torch::Tensor col, torch::Tensor a, torch::Tensor b,
                            torch::Tensor c, bool mean) {
  check_gated(rowptr, col, a, b, c);
  const c10::cuda::CUDAGuard guard(c.device());
  const int64_t rows = rowptr.numel() - 1, d = c.size(1);
  auto out = torch::zeros({rows, d}, c.options());
  if (rows * d == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(c.scalar_type(), "csr_gated_forward_cuda", [&] {
    DISPATCH_INDEX(rowptr.scalar_type(), [&] {
      gated_rows_kernel<scalar_t, index_t><<<blocks_for(rows * d), kThreads, 0, stream>>>(
          rowptr.data_ptr<index_t>(), col.data_ptr<index_t>(), a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(),
          c.data_ptr<scalar_t>(), nullptr, out.data_ptr<scalar_t>(), rows, d, mean);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::vector<torch::Tensor> gated_backward(torch::Tensor rowptr, torch::Tensor col, torch::Tensor tptr,
                                          torch::Tensor trow, torch::Tensor a, torch::Tensor b, torch::Tensor c,
                                          torch::Tensor g, bool need_a, bool need_bc) {
  check_gated(rowptr, col, a, b, c);
  TORCH_CHECK(g.sizes() == a.sizes() && g.is_contiguous() && g.dtype() == c.dtype(), "gated: g must be like a");
  TORCH_CHECK(tptr.scalar_type() == rowptr.scalar_type() && trow.scalar_type() == rowptr.scalar_type() &&
                  tptr.numel() == b.size(0) + 1 && tptr.is_contiguous() && trow.is_contiguous() && tptr.is_cuda() &&
                  trow.is_cuda(), "gated: tptr [n_src + 1] and trow of rowptr's dtype, on the device");
  const c10::cuda::CUDAGuard guard(c.device());
  const int64_t rows = rowptr.numel() - 1, d = c.size(1), n_src = b.size(0);
  torch::Tensor ga, gb, gc;
  if (need_a) ga = torch::zeros({rows, d}, c.options());
  if (need_bc) { gb = torch::zeros({n_src, d}, c.options()); gc = torch::zeros({n_src, d}, c.options()); }
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(c.scalar_type(), "csr_gated_backward_cuda", [&] {
    DISPATCH_INDEX(rowptr.scalar_type(), [&] {
      if (need_a && rows * d > 0)
        gated_rows_kernel<scalar_t, index_t><<<blocks_for(rows * d), kThreads, 0, stream>>>(
            rowptr.data_ptr<index_t>(), col.data_ptr<index_t>(), a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(),
            c.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), ga.data_ptr<scalar_t>(), rows, d, false);
      if (need_bc && n_src * d > 0)
        gated_sources_kernel<scalar_t, index_t><<<blocks_for(n_src * d), kThreads, 0, stream>>>(
            tptr.data_ptr<index_t>(), trow.data_ptr<index_t>(), a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(),
            c.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), gb.data_ptr<scalar_t>(), gc.data_ptr<scalar_t>(),
            n_src, d);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {ga, gb, gc};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyg_pipe fused CSR gather-aggregate kernels (CUDA)";
  m.def("forward", &forward, "CSR aggregate forward: (out, arg)");
  m.def("set_slice_edges", [](int64_t s) { TORCH_CHECK(s >= 0, "slice edges must be >= 0"); g_slice_edges = s; },
        "edges per slice of the edge-balanced sum/mean kernel (0: one group per row)");
  m.def("slice_edges", []() { return g_slice_edges; }, "the current edges per slice");
  m.def("edge_dot", &edge_dot, "per-edge <g[row], x[col]>");
  m.def("max_backward", &max_backward, "max aggregate backward through the arg-max (atomicAdd)");
  m.def("gated_forward", &gated_forward, "gated CSR sum: sum_e sigmoid(a[i] + b[j]) * c[j]");
  m.def("gated_backward", &gated_backward, "gradients of gated_forward (grad_a, grad_b, grad_c)");
}
