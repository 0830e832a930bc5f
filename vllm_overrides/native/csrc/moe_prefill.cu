// MoE routing (decode and prefill) and the prefill expert order
// (vllm_overrides.native.kernels.moe_route / moe_prefill).
//
// Prefill runs the routed experts as two grouped GEMMs over token rows sorted by expert. Around
// the GEMMs, four launches replace the PyTorch path's ~20 (sort, inverse permutation, gathers,
// the three-pass activation, the combine):
//   1. moe_route_count -- softmax + top-k (upstream's tie order: group_topk in common.cuh) +
//      renormalise per token, and
//      each chosen expert's count: every (token, slot) pair takes its place inside its expert's
//      group through atomic increments (a pair's GEMM row does not depend on where in the group
//      it sits, so the nondeterministic order inside a group changes no result);
//   2. moe_permute -- every block scans the counts into group offsets (E <= 1024 ints in shared
//      memory), then copies token rows straight into expert order, with the routing weight and
//      the inverse map of each pair; block 0 writes the group ends the grouped GEMM takes;
//   3. moe_act -- silu(gate) * up * routing weight, rounded once;
//   4. moe_combine -- out[t] = sum_j y[inverse[t, j]] (float32, fixed j order), plus the shared
//      expert's output times sigmoid of its gate, in one pass over y.
// With our own grouped GEMMs (moe_grouped_gemm.cu), moe_order replaces 2 (the same places, no
// row moved: the gate/up GEMM gathers x's rows itself) and the GEMM's epilogue replaces 3.
#include "common.cuh"

namespace {

// ------------------------------------------------------------------------------------------
// Routing (group_topk): many tokens per block, one lane group per token. With `counts`
// (prefill), each chosen expert's count too: a block-local histogram, then one global atomic
// per (block, expert) instead of one per pair; a pair's slot in its expert's group is the
// block's base for that expert + its rank inside the block.
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void moe_route_kernel(const T* __restrict__ logits, int64_t s_row, int64_t T_, int E,
                                 int top_k, bool renormalize, float* __restrict__ w_out,
                                 int64_t* __restrict__ id_out, int* __restrict__ counts,
                                 int* __restrict__ slot_out) {
  VO_DYN_SMEM(float, sm);
  const int tpb = blockDim.x / kRouteLanes;  // tokens per block
  float* lg = sm;                                   // [tpb][E]
  int* cnt = reinterpret_cast<int*>(lg + tpb * E);  // [E] block histogram (with counts)
  int* base = cnt + E;                              // [E] block's first slot
  const int tid = threadIdx.x, lane = tid % kRouteLanes, tok = tid / kRouteLanes;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * tpb + tok;
  const bool live = t < T_;
  float* row = lg + tok * E;
  if (counts != nullptr)
    for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
  for (int e = lane; e < E; e += kRouteLanes) {
    const float v = live ? to_f(logits[t * s_row + e]) : -INFINITY;
    row[e] = v != v ? -INFINITY : v;  // NaN ranks as -inf: the ranks stay a permutation
  }
  __syncthreads();
  float w;
  int ex;
  group_topk(row, E, top_k, renormalize, lane, w, ex);  // every lane takes part
  const bool owner = live && lane < top_k;
  const int64_t p = t * top_k + lane;
  if (owner) {
    w_out[p] = w;
    id_out[p] = ex;
  }
  if (counts == nullptr) return;  // block-uniform
  int rank = 0;
  if (owner) rank = atomicAdd(&cnt[ex], 1);
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x)
    if (cnt[e] > 0) base[e] = atomicAdd(&counts[e], cnt[e]);
  __syncthreads();
  if (owner) slot_out[p] = base[ex] + rank;
}

// ------------------------------------------------------------------------------------------
// Token rows into expert order. Pairs p = t * top_k + j go to row offs[e] + slot[p] of `xs`.
// A block takes kPermuteTokens tokens at a time: their pairs' places first (one load round),
// then each token's row is read once and written to its top_k places. (One pair at a time, a
// chain of dependent loads per 4 KB row, ran at ~65 % of the copy rate on the H200; 4 tokens a
// round at 81 %, 8 at 86 %: LEDGER.)
// ------------------------------------------------------------------------------------------

constexpr int kPermuteTokens = 8;

// Inclusive scan of buf[0 .. E) in place of a double buffer buf[0 .. 2E) (Hillis-Steele:
// log2(E) rounds); returns where the result sits. Block-collective, behind a barrier.
__device__ __forceinline__ const int* block_scan(int* buf, int E) {
  int src = 0;
  for (int s = 1; s < E; s <<= 1) {
    const int* in = buf + src * E;
    int* out = buf + (1 - src) * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) out[e] = in[e] + (e >= s ? in[e - s] : 0);
    __syncthreads();
    src = 1 - src;
  }
  return buf + src * E;
}

// With x == nullptr no row moves (moe_order): `src` gets each expert-order row's token and
// block 0 writes `tile_starts` [E + 1], the first kGroupedTileRows-row tile of each expert's
// group (the grouped GEMM's grid map), instead.
template <typename T>
__global__ void moe_permute_kernel(const T* __restrict__ x, int64_t s_x, int H,
                                   const float* __restrict__ w, const int64_t* __restrict__ ids,
                                   const int* __restrict__ counts, const int* __restrict__ slot,
                                   int E, int top_k, int64_t T_, T* __restrict__ xs,
                                   float* __restrict__ ws, int64_t* __restrict__ inverse,
                                   int* __restrict__ ends, int* __restrict__ src,
                                   int* __restrict__ tile_starts) {
  VO_DYN_SMEM(int, scan);  // 4 * E ints: two double-buffered scans
  int64_t* pos = reinterpret_cast<int64_t*>(scan + 4 * E);  // [kPermuteTokens * top_k]
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += blockDim.x) scan[e] = counts[e];
  __syncthreads();
  const int* incl = block_scan(scan, E);  // group ends; group e starts at incl[e] - counts[e]
  if (blockIdx.x == 0) {
    for (int e = tid; e < E; e += blockDim.x) ends[e] = incl[e];
    if (tile_starts != nullptr) {  // block-uniform
      int* tiles = scan + 2 * E;
      for (int e = tid; e < E; e += blockDim.x)
        tiles[e] = (counts[e] + kGroupedTileRows - 1) / kGroupedTileRows;
      __syncthreads();
      const int* tincl = block_scan(tiles, E);
      if (tid == 0) tile_starts[0] = 0;
      for (int e = tid; e < E; e += blockDim.x) tile_starts[e + 1] = tincl[e];
    }
  }
  constexpr int N = Vec<T>::N;
  for (int64_t t0 = blockIdx.x * (int64_t)kPermuteTokens; t0 < T_;
       t0 += (int64_t)gridDim.x * kPermuteTokens) {
    const int nt = T_ - t0 < kPermuteTokens ? static_cast<int>(T_ - t0) : kPermuteTokens;
    for (int i = tid; i < nt * top_k; i += blockDim.x) {
      const int64_t p = t0 * top_k + i;
      const int e = static_cast<int>(ids[p]);
      const int64_t q = incl[e] - counts[e] + slot[p];
      pos[i] = q;
      ws[q] = w[p];
      inverse[p] = q;
      if (src != nullptr) src[q] = static_cast<int>(t0 + i / top_k);
    }
    if (x == nullptr) continue;  // block-uniform: moe_order moves no rows
    __syncthreads();
    for (int c = tid * N; c < H; c += blockDim.x * N) {
      uint4 v[kPermuteTokens];
#pragma unroll
      for (int u = 0; u < kPermuteTokens; ++u)
        if (u < nt) v[u] = *reinterpret_cast<const uint4*>(x + (t0 + u) * s_x + c);
#pragma unroll
      for (int u = 0; u < kPermuteTokens; ++u)
        if (u < nt)
          for (int j = 0; j < top_k; ++j)
            *reinterpret_cast<uint4*>(xs + pos[u * top_k + j] * H + c) = v[u];
    }
    __syncthreads();  // `pos` is rewritten by the next round
  }
}

// ------------------------------------------------------------------------------------------
// out[p, c] = silu(h[p, c]) * h[p, I + c] * ws[p] (ws optional), rounded once to T.
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void moe_act_kernel(const T* __restrict__ h, int I, const float* __restrict__ ws,
                               int64_t P, T* __restrict__ out) {
  constexpr int N = Vec<T>::N;
  const int per_row = I / N;
  const int64_t n = P * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = i / per_row;
    const int c = static_cast<int>(i % per_row) * N;
    Vec<T> g, u;
    g.load(h + p * 2 * I + c);
    u.load(h + p * 2 * I + I + c);
    const float wp = ws != nullptr ? ws[p] : 1.0f;
    float r[N];
#pragma unroll
    for (int q = 0; q < N; ++q) r[q] = silu_f(g.f[q]) * u.f[q] * wp;
    store_vec(out + p * I + c, r);
  }
}

// ------------------------------------------------------------------------------------------
// out[t] = sum_j y[inverse[t * top_k + j]] (+ sigmoid(add_gate[t]) * add[t]); one block per
// token (grid-stride), float32 sums in a fixed order.
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void moe_combine_kernel(const T* __restrict__ y, int H,
                                   const int64_t* __restrict__ inverse, int top_k, int64_t T_,
                                   const T* __restrict__ add, const T* __restrict__ add_gate,
                                   int64_t s_gate, T* __restrict__ out) {
  constexpr int N = Vec<T>::N;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const float gate =
        add != nullptr ? (add_gate != nullptr ? sigmoid_f(to_f(add_gate[t * s_gate])) : 1.f) : 0.f;
    for (int c = threadIdx.x * N; c < H; c += blockDim.x * N) {
      float acc[N];
#pragma unroll
      for (int q = 0; q < N; ++q) acc[q] = 0.f;
      for (int j = 0; j < top_k; ++j) {
        Vec<T> v;
        v.load(y + inverse[t * top_k + j] * H + c);
#pragma unroll
        for (int q = 0; q < N; ++q) acc[q] += v.f[q];
      }
      if (add != nullptr) {
        Vec<T> a;
        a.load(add + t * H + c);
#pragma unroll
        for (int q = 0; q < N; ++q) acc[q] += gate * a.f[q];
      }
      store_vec(out + t * H + c, acc);
    }
  }
}

// Blocks for a grid-stride loop over `work` items: enough to fill the device several times over,
// never more than the work.
int64_t grid_for(int64_t work, int64_t cap = 4096) { return std::max<int64_t>(1, std::min(work, cap)); }

bool vec_ok(const at::Tensor& t, int64_t row_elems) {
  return (row_elems * t.element_size()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// ------------------------------------------------------------------------------------------
// Host wrappers
// ------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& logits,
                                                                 int64_t top_k, bool renormalize,
                                                                 bool count) {
  TORCH_CHECK(VO_ON_DEVICE(logits) && logits.dim() == 2 && logits.stride(1) == 1,
              "moe_route: [T, E] logits on the kernels' device with unit stride");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= std::min<int64_t>(E, kRouteLanes) && E <= 1024,
              "moe_route: top_k <= min(E, 16), E <= 1024");
  VO_DEVICE_GUARD(logits);
  auto w = at::empty({T, top_k}, logits.options().dtype(at::kFloat));
  auto ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  at::Tensor counts, slot;
  if (count) {
    counts = at::zeros({E}, logits.options().dtype(at::kInt));
    slot = at::empty({T, top_k}, logits.options().dtype(at::kInt));
  }
  if (T == 0) return {w, ids, counts, slot};
  // Tokens per block: 16 (256 threads) while their logits fit in 16 KB, else 4 (64 threads,
  // also the smallest block: a decode-sized call).
  const int tpb = T <= 4 || E > 256 ? 4 : 16;
  const size_t smem = tpb * E * sizeof(float) + (count ? 2 * E * sizeof(int) : 0);
  VO_DISPATCH_FLOATS(logits.scalar_type(), "moe_route", [&] {
    VO_LAUNCH(moe_route_kernel<scalar_t>, (T + tpb - 1) / tpb, tpb * kRouteLanes, smem,
        logits.data_ptr<scalar_t>(), logits.stride(0), T, static_cast<int>(E),
        static_cast<int>(top_k), renormalize, w.data_ptr<float>(), ids.data_ptr<int64_t>(),
        count ? counts.data_ptr<int>() : nullptr, count ? slot.data_ptr<int>() : nullptr);
  });
  return {w, ids, counts, slot};
}

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k,
                                             bool renormalize) {
  auto r = route(logits, top_k, renormalize, false);
  return {std::get<0>(r), std::get<1>(r)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_count(
    const at::Tensor& logits, int64_t top_k, bool renormalize) {
  return route(logits, top_k, renormalize, true);
}

// moe_permute, or with x undefined moe_order: (xs or src, ws, inverse, ends, tile_starts).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, const at::Tensor& counts,
    const at::Tensor& slot) {
  const bool rows = x.defined();
  const at::Tensor& dev = rows ? x : w;
  TORCH_CHECK(VO_ON_DEVICE(dev), "moe_permute / moe_order: tensors on the kernels' device");
  const int64_t T = ids.size(0), k = ids.size(1), E = counts.size(0);
  const int64_t H = rows ? x.size(1) : 0;
  if (rows) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) == T, "moe_permute: x [T, H]");
    TORCH_CHECK(vec_ok(x, H) && (x.stride(0) * x.element_size()) % 16 == 0,
                "moe_permute: rows of x must be 16-byte vectors");
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong &&
                  counts.scalar_type() == at::kInt && slot.scalar_type() == at::kInt &&
                  w.is_contiguous() && ids.is_contiguous() && slot.is_contiguous() &&
                  ids.dim() == 2 && w.sizes() == ids.sizes() && slot.sizes() == ids.sizes() &&
                  E <= 1024,
              "moe_permute: w [T, k] float32, ids [T, k] int64, counts [E] int32, slot int32");
  TORCH_CHECK(T * k < (int64_t{1} << 31), "moe_order: fewer than 2^31 pairs");
  VO_DEVICE_GUARD(dev);
  const int64_t P = T * k;
  auto xs = rows ? at::empty({P, H}, x.options()) : at::empty({P}, w.options().dtype(at::kInt));
  auto ws = at::empty({P}, w.options());
  auto inverse = at::empty({P}, w.options().dtype(at::kLong));
  auto ends = at::empty({E}, w.options().dtype(at::kInt));
  at::Tensor tile_starts;
  if (!rows) tile_starts = at::empty({E + 1}, w.options().dtype(at::kInt));
  const auto dtype = rows ? x.scalar_type() : at::kFloat;
  VO_DISPATCH_FLOATS(dtype, "moe_permute", [&] {
    VO_LAUNCH(moe_permute_kernel<scalar_t>,
        grid_for((T + kPermuteTokens - 1) / kPermuteTokens, 2048), kBlock,
        4 * E * sizeof(int) + kPermuteTokens * k * sizeof(int64_t),
        rows ? x.data_ptr<scalar_t>() : nullptr, rows ? x.stride(0) : 0, static_cast<int>(H),
        w.data_ptr<float>(), ids.data_ptr<int64_t>(), counts.data_ptr<int>(),
        slot.data_ptr<int>(), static_cast<int>(E), static_cast<int>(k), T,
        rows ? xs.data_ptr<scalar_t>() : nullptr, ws.data_ptr<float>(),
        inverse.data_ptr<int64_t>(), ends.data_ptr<int>(), rows ? nullptr : xs.data_ptr<int>(),
        rows ? nullptr : tile_starts.data_ptr<int>());
  });
  return {xs, ws, inverse, ends, tile_starts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_permute(
    const at::Tensor& x, const at::Tensor& w, const at::Tensor& ids, const at::Tensor& counts,
    const at::Tensor& slot) {
  TORCH_CHECK(x.defined(), "moe_permute: x [T, H]");
  auto r = permute(x, w, ids, counts, slot);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

// The expert order without moving rows, for the grouped GEMM that gathers them itself.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_order(
    const at::Tensor& w, const at::Tensor& ids, const at::Tensor& counts,
    const at::Tensor& slot) {
  return permute(at::Tensor(), w, ids, counts, slot);
}

at::Tensor moe_act(const at::Tensor& h, const c10::optional<at::Tensor>& ws) {
  TORCH_CHECK(VO_ON_DEVICE(h) && h.dim() == 2 && h.is_contiguous() && h.size(1) % 2 == 0,
              "moe_act: contiguous h [P, 2I]");
  const int64_t P = h.size(0), I = h.size(1) / 2;
  TORCH_CHECK(vec_ok(h, I), "moe_act: I must hold whole 16-byte vectors");
  const bool has_w = ws.has_value();
  if (has_w)
    TORCH_CHECK(ws->scalar_type() == at::kFloat && ws->is_contiguous() && ws->numel() == P,
                "moe_act: ws [P] float32");
  VO_DEVICE_GUARD(h);
  auto out = at::empty({P, I}, h.options());
  if (P == 0) return out;
  const int64_t vecs = P * I / (16 / h.element_size());
  VO_DISPATCH_FLOATS(h.scalar_type(), "moe_act", [&] {
    VO_LAUNCH(moe_act_kernel<scalar_t>, grid_for((vecs + kBlock - 1) / kBlock, 8192), kBlock, 0,
        h.data_ptr<scalar_t>(), static_cast<int>(I), has_w ? ws->data_ptr<float>() : nullptr, P,
        out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& inverse, int64_t top_k,
                       const c10::optional<at::Tensor>& add,
                       const c10::optional<at::Tensor>& add_gate) {
  TORCH_CHECK(VO_ON_DEVICE(y) && y.dim() == 2 && y.is_contiguous(), "moe_combine: y [P, H]");
  const int64_t H = y.size(1);
  TORCH_CHECK(vec_ok(y, H), "moe_combine: rows of y must be 16-byte vectors");
  TORCH_CHECK(inverse.scalar_type() == at::kLong && inverse.is_contiguous() && top_k >= 1 &&
                  inverse.numel() % top_k == 0,
              "moe_combine: inverse [T * top_k] int64");
  const int64_t T = inverse.numel() / top_k;
  if (add.has_value())
    TORCH_CHECK(add->scalar_type() == y.scalar_type() && add->is_contiguous() &&
                    add->dim() == 2 && add->size(0) == T && add->size(1) == H && vec_ok(*add, H),
                "moe_combine: add [T, H] like y");
  if (add_gate.has_value())
    TORCH_CHECK(add.has_value() && add_gate->scalar_type() == y.scalar_type() &&
                    add_gate->dim() == 2 && add_gate->size(0) == T && add_gate->size(1) == 1,
                "moe_combine: add_gate [T, 1] like y, with add");
  VO_DEVICE_GUARD(y);
  auto out = at::empty({T, H}, y.options());
  if (T == 0) return out;
  VO_DISPATCH_FLOATS(y.scalar_type(), "moe_combine", [&] {
    VO_LAUNCH(moe_combine_kernel<scalar_t>, grid_for(T, 8192), kBlock, 0,
        y.data_ptr<scalar_t>(), static_cast<int>(H), inverse.data_ptr<int64_t>(),
        static_cast<int>(top_k), T, add.has_value() ? add->data_ptr<scalar_t>() : nullptr,
        add_gate.has_value() ? add_gate->data_ptr<scalar_t>() : nullptr,
        add_gate.has_value() ? add_gate->stride(0) : 0, out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vo_kernels, m) {
  m.def("moe_route(Tensor logits, int top_k, bool renormalize) -> (Tensor, Tensor)");
  m.def("moe_route_count(Tensor logits, int top_k, bool renormalize)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_permute(Tensor x, Tensor w, Tensor ids, Tensor counts, Tensor slot)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_order(Tensor w, Tensor ids, Tensor counts, Tensor slot)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_act(Tensor h, Tensor? ws) -> Tensor");
  m.def("moe_combine(Tensor y, Tensor inverse, int top_k, Tensor? add, Tensor? add_gate)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(vo_kernels, VO_DISPATCH_KEY, m) {
  m.impl("moe_route", &moe_route);
  m.impl("moe_route_count", &moe_route_count);
  m.impl("moe_permute", &moe_permute);
  m.impl("moe_order", &moe_order);
  m.impl("moe_act", &moe_act);
  m.impl("moe_combine", &moe_combine);
}
