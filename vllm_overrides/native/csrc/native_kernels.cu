// Fused decode kernels for Qwen3.5 / Qwen3.6 MoE (vllm_overrides.native.kernels).
//
// Portability rules (the target is a CUDA-compatible, Triton-less card with 64-lane warps):
// plain CUDA C++ only -- no Triton, no CUTLASS/CuTe, no inline PTX; no warp size is assumed
// (reductions loop over `warpSize`, sub-group shuffles use widths <= 16 that divide any warp,
// and the shuffle mask is `__activemask()`, whose type is the platform's own; every block size
// is a multiple of 64); float32 accumulation, no float64 anywhere on the device.
//
// Each op's contract is its PyTorch path's (vllm_overrides/native/{gdn,moe,rmsnorm}.py); the
// float64 references and tests/native/test_cuda_kernels.py pin both.

#include <map>
#include <mutex>

#include "common.cuh"

namespace {

// ------------------------------------------------------------------------------------------
// RMSNorms
// ------------------------------------------------------------------------------------------

// Lanes per row of the norms that give a row to a group of lanes: a width that divides every
// warp, so the row's sum is a group shuffle (no shared memory, no barrier).
constexpr int kNormLanes = 16;

// One chunk of a row as floats: a 16-byte vector of T (kVec) or one element.
template <typename T, bool kVec>
__device__ __forceinline__ void load_chunk(const T* p, float* f) {
  if constexpr (kVec) {
    Vec<T> v;
    v.load(p);
#pragma unroll
    for (int u = 0; u < Vec<T>::N; ++u) f[u] = v.f[u];
  } else {
    f[0] = to_f(*p);
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void store_chunk(T* p, const float* f) {
  if constexpr (kVec) store_vec(p, f);
  else *p = static_cast<T>(f[0]);
}

// Qwen (1 + w) RMSNorm over rows of H; with `residual`, s = x + residual is normalised and
// written (rounded) to `res_out`. Statistics, weight and sum in float32 (rmsnorm.py); the output
// is computed from the unrounded float32 sum.
//
// A row is cut into chunks of W elements -- one 16-byte vector of T with kVec (rows of whole,
// 16-byte aligned vectors), else one element -- and chunk c belongs to lane c % G of the row's
// G lanes. Each lane keeps its first K chunks (and their weights) in registers between the sum
// and the output, so the row is read once and needs no shared-memory copy: the host picks G and
// K so that the row fits (H = 2048 bf16: 256 lanes, one vector each). Only a longer row's
// remaining chunks are read again (the float sum recomputed: the same value).
// G = kNormLanes: blockDim / G rows per block, the row's sum is a group shuffle (no barrier);
// G = blockDim: one row per block, a block sum.
// With K == 1 (H = 2048 in 16-bit types, prefill and decode) the kernel is held to full
// occupancy, 2048 threads per SM (<= 32 registers at 256 threads, no spill on sm_90): left
// alone, ptxas took 38 registers and 3/4 of the threads -- fewer loads in flight in a
// memory-bound kernel.
constexpr int kGemmaMaxK = 4;  // chunks per lane in registers at most; longer rows read twice

#ifdef VO_CPU_EMULATION
#define VO_NORM_BOUNDS(min_blocks)
#else
#define VO_NORM_BOUNDS(min_blocks) __launch_bounds__(kBlock, min_blocks)
#endif

template <typename T, int K, bool kVec>
__global__ void VO_NORM_BOUNDS(K == 1 ? 2048 / kBlock : 1)
    gemma_rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                          const T* __restrict__ weight, T* __restrict__ out,
                          T* __restrict__ res_out, int64_t rows, int H, int G, float eps) {
  constexpr int W = kVec ? Vec<T>::N : 1;
  __shared__ float red[kMaxWarps];
  const int lane = threadIdx.x % G;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / G) + threadIdx.x / G;
  const bool live = r < rows;  // a dead group still takes part in the (group-local) shuffle
  const int64_t off = live ? r * H : 0;
  const int nc = live ? (H + W - 1) / W : 0;  // chunks of this row
  // The float32 sum x (+ residual) of chunk c.
  auto sum_of = [&](int c, float* v) {
    const int64_t i = off + static_cast<int64_t>(c) * W;
    load_chunk<T, kVec>(x + i, v);
    if (residual != nullptr) {
      float rv[W];
      load_chunk<T, kVec>(residual + i, rv);
#pragma unroll
      for (int u = 0; u < W; ++u) v[u] += rv[u];
    }
  };
  float v[K][W], w[K][W];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = lane + k * G;
    if (c < nc) {
      sum_of(c, v[k]);
      load_chunk<T, kVec>(weight + c * W, w[k]);  // loaded early: off the path after the sum
      if (residual != nullptr) store_chunk<T, kVec>(res_out + off + c * W, v[k]);
#pragma unroll
      for (int u = 0; u < W; ++u) ss += v[k][u] * v[k][u];
    }
  }
  if constexpr (K == kGemmaMaxK) {  // a row longer than the registers hold (the host's K)
    for (int c = lane + K * G; c < nc; c += G) {
      float t[W];
      sum_of(c, t);
      if (residual != nullptr) store_chunk<T, kVec>(res_out + off + c * W, t);
#pragma unroll
      for (int u = 0; u < W; ++u) ss += t[u] * t[u];
    }
  }
  if (G == static_cast<int>(blockDim.x)) {  // block-uniform
    float s[1] = {ss};
    block_sum<1>(s, red);
    ss = s[0];
  } else {
    ss = group_sum(ss, G);
  }
  const float inv = rsqrtf(ss / H + eps);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = lane + k * G;
    if (c < nc) {
      const int64_t i = off + static_cast<int64_t>(c) * W;
      float o[W];
#pragma unroll
      for (int u = 0; u < W; ++u) o[u] = v[k][u] * inv * (w[k][u] + 1.0f);
      store_chunk<T, kVec>(out + i, o);
    }
  }
  if constexpr (K == kGemmaMaxK) {
    for (int c = lane + K * G; c < nc; c += G) {
      const int64_t i = off + static_cast<int64_t>(c) * W;
      float t[W], wt[W], o[W];
      sum_of(c, t);
      load_chunk<T, kVec>(weight + c * W, wt);
#pragma unroll
      for (int u = 0; u < W; ++u) o[u] = t[u] * inv * (wt[u] + 1.0f);
      store_chunk<T, kVec>(out + i, o);
    }
  }
}

// GDN output norm per value head: out = rms(x) * w * act(z); x, z are [T, HV, V] with any
// strides on the first two dims (z is a slice of the projection output), out contiguous.
// One row (token, head) per group of kNormLanes lanes, blockDim / kNormLanes rows per block;
// with `vec` (rows of whole, aligned 16-byte vectors) each lane loads Vec<T> chunks.
// A prefill of 16K tokens has 131K such rows: one block per row left most threads idle behind
// two barriers (~7x its memory time on the H200).

template <typename T>
__global__ void rms_norm_gated_kernel(const T* __restrict__ x, const T* __restrict__ z,
                                      const T* __restrict__ weight, T* __restrict__ out,
                                      int64_t rows, int HV, int V, int64_t sx0, int64_t sx1,
                                      int64_t sz0, int64_t sz1, float eps, bool sigmoid_gate,
                                      bool vec) {
  constexpr int N = Vec<T>::N;
  const int lane = threadIdx.x % kNormLanes;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kNormLanes) +
                    threadIdx.x / kNormLanes;
  const bool live = n < rows;  // dead groups still take part in the (group-local) shuffle
  const int64_t t = live ? n / HV : 0, h = live ? n % HV : 0;
  const T* xr = x + t * sx0 + h * sx1;
  const T* zr = z + t * sz0 + h * sz1;
  T* orow = out + n * V;
  float ss = 0.f;
  if (vec) {
    for (int i = lane * N; live && i < V; i += kNormLanes * N) {
      Vec<T> r;
      r.load(xr + i);
#pragma unroll
      for (int u = 0; u < N; ++u) ss += r.f[u] * r.f[u];
    }
    const float inv = rsqrtf(group_sum(ss, kNormLanes) / V + eps);
    for (int i = lane * N; live && i < V; i += kNormLanes * N) {
      Vec<T> r, g, w;
      r.load(xr + i);
      g.load(zr + i);
      w.load(weight + i);
      float o[N];
#pragma unroll
      for (int u = 0; u < N; ++u)
        o[u] = r.f[u] * inv * w.f[u] * (sigmoid_gate ? sigmoid_f(g.f[u]) : silu_f(g.f[u]));
      store_vec(orow + i, o);
    }
  } else {
    for (int i = lane; live && i < V; i += kNormLanes) {
      const float v = to_f(xr[i]);
      ss += v * v;
    }
    const float inv = rsqrtf(group_sum(ss, kNormLanes) / V + eps);
    for (int i = lane; live && i < V; i += kNormLanes) {
      const float g = to_f(zr[i]);
      orow[i] = static_cast<T>(to_f(xr[i]) * inv * to_f(weight[i]) *
                               (sigmoid_gate ? sigmoid_f(g) : silu_f(g)));
    }
  }
}

// ------------------------------------------------------------------------------------------
// Gated DeltaNet decode: one block per (sequence, key head), covering the key head's q and k
// channels and the R = HV / H value heads that read them, so every conv channel and every
// state row belongs to exactly one block (no races, one launch per layer). With `z`, the
// block also applies the layer's gated output norm to its R whole value heads
// (rms(o) * w * act(z), as rms_norm_gated_kernel does after the rounding to T that the
// unfused output takes): one launch fewer per GDN layer and decode step.
// ------------------------------------------------------------------------------------------

constexpr int kGdnGroup = 16;  // lanes per state row (K / 16 floats each)
// State rows per lane group and pass: their loads are in flight together (decode is
// latency-bound at small batches), and the first pass's are issued before the conv.
#ifndef VO_GDN_DECODE_ROWS
#define VO_GDN_DECODE_ROWS 4
#endif
constexpr int kGdnRows = VO_GDN_DECODE_ROWS;

// Raw float32 state rows row0 .. row0 + kGdnRows - 1 of a block's heads (K <= 128: two float4
// per lane, columns (j * kGdnGroup + lane) * 4). Rows past `RV` repeat row0 (never written).
__device__ __forceinline__ void gdn_load_rows(float (&hv)[kGdnRows][8], const float* st, int row0,
                                              int RV, int K, int lane) {
#pragma unroll
  for (int u = 0; u < kGdnRows; ++u) {
    const float* r = st + (int64_t)(row0 + (row0 + u < RV ? u : 0)) * K;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int col = (j * kGdnGroup + lane) * 4;
      if (col < K) {
        const float4 t = *reinterpret_cast<const float4*>(r + col);
        hv[u][4 * j] = t.x;
        hv[u][4 * j + 1] = t.y;
        hv[u][4 * j + 2] = t.z;
        hv[u][4 * j + 3] = t.w;
      }
    }
  }
}

// Written for kGdnBlock threads: the bound keeps the state rows' registers within what a block
// of that size may hold on any device (kGdnRows = 8 asked for more than sm_90 grants).
#ifdef VO_CPU_EMULATION
#define VO_GDN_DECODE_BOUNDS
#else
#define VO_GDN_DECODE_BOUNDS __launch_bounds__(kGdnBlock)
#endif

// Conv window of one channel: [state..., x] dotted with the channel's taps (in order, as the
// PyTorch path), and with `shift` the state moved on by one (oldest dropped, x appended).
template <typename T>
__device__ __forceinline__ float gdn_conv_channel(T* st, int64_t cs_w, const T* wr, int W, T xin,
                                                  float acc, bool shift) {
  if (W == 4) {  // Qwen3.5/3.6: the three state loads issued together, then the shift
    const T s0 = st[0], s1 = st[cs_w], s2 = st[2 * cs_w];
    acc += to_f(wr[0]) * to_f(s0);
    acc += to_f(wr[1]) * to_f(s1);
    acc += to_f(wr[2]) * to_f(s2);
    if (shift) {
      st[0] = s1;
      st[cs_w] = s2;
      st[2 * cs_w] = xin;
    }
  } else {
    T prev = st[0];
    for (int j = 0; j < W - 1; ++j) {
      acc += to_f(wr[j]) * to_f(prev);
      const T next = j + 1 < W - 1 ? st[(j + 1) * cs_w] : xin;
      if (shift) st[j * cs_w] = next;
      prev = next;
    }
  }
  return acc + to_f(wr[W - 1]) * to_f(xin);
}

// One block per Rb value heads and sequence. Rb = R = HV / H (a key head's value heads) where
// the batch fills the GPU; Rb = 1 at small batches, which then spread over HV SMs instead of H
// (the H200's B = 1 step, LEDGER). With Rb < R, the R / Rb blocks of a key head share its q/k
// conv channels, whose state the call shifts in place: every block reads the old window, and
// the last of them to finish reading (an atomic count per (sequence, key head) in `counts`, zero
// between calls; the last block resets it) writes the shift. Each block shifts its v channels.
template <typename T>
__global__ void VO_GDN_DECODE_BOUNDS gdn_decode_kernel(
    const T* __restrict__ qkv, int64_t s_qkv,                   // [B, D]
    const T* __restrict__ a, int64_t s_a, const T* __restrict__ b, int64_t s_b,  // [B, HV]
    T* __restrict__ conv_state, int64_t cs_slot, int64_t cs_d, int64_t cs_w,    // [S, D, W-1]
    const T* __restrict__ conv_w, const T* __restrict__ conv_b, int W,          // [D, W]
    const float* __restrict__ A_log, const float* __restrict__ dt_bias,         // [HV]
    float* __restrict__ ssm, int64_t ssm_slot,                                   // [S, HV, V, K]
    T* __restrict__ out, int64_t s_out,                                          // [B, HV, V]
    const int32_t* __restrict__ slots, int H, int HV, int K, int V, float scale, bool silu,
    const T* __restrict__ z, int64_t s_z0, int64_t s_z1,                         // [B, HV, V]
    const T* __restrict__ norm_w, float norm_eps, bool norm_sigmoid, int Rb,
    int* __restrict__ counts) {                                                  // [B * H]
  VO_DYN_SMEM(float, sm);  // q[K] k[K] v[Rb*V] gates[2Rb] (with z: o[Rb*V])
  __shared__ float red[2 * kMaxWarps];
  __shared__ int last;
  const int hv0 = blockIdx.x * Rb, bi = blockIdx.y, tid = threadIdx.x;
  const int R = HV / H, h = hv0 / R, S = R / Rb;
  float* q = sm;
  float* k = q + K;
  float* v = k + K;
  float* gate = v + Rb * V;  // [0, Rb): exp(g); [Rb, 2Rb): beta
  float* ov = gate + 2 * Rb;  // raw outputs, rounded to T, when the norm is fused
  const int slot = slots[bi];
  T* o = out + bi * s_out + (int64_t)hv0 * V;
  if (slot <= 0) {  // null block (0) or padding (-1): zeros, every state untouched
    for (int i = tid; i < Rb * V; i += blockDim.x) o[i] = static_cast<T>(0.f);
    return;
  }
  // This group's first state rows depend only on the slot: load them now, so that their
  // latency overlaps the conv, the gates and the norms (H200, B = 1: see the LEDGER).
  const int lane = tid % kGdnGroup, groups = blockDim.x / kGdnGroup;
  const int RV = Rb * V, first = (tid / kGdnGroup) * kGdnRows;
  float* st = ssm + (int64_t)slot * ssm_slot + (int64_t)hv0 * V * K;
  float hv_rows[kGdnRows][8];
  if (first < RV) gdn_load_rows(hv_rows, st, first, RV, K, lane);
  if (tid < Rb) {
    const int hv = hv0 + tid;
    const float x = to_f(a[bi * s_a + hv]) + dt_bias[hv];
    const float sp = x > 20.f ? x : log1pf(expf(x));  // softplus, threshold 20
    gate[tid] = expf(-expf(A_log[hv]) * sp);
    gate[Rb + tid] = sigmoid_f(to_f(b[bi * s_b + hv]));
  }
  // Conv of this block's channels (q, k of key head h; v of its value heads): SiLU, rounded to
  // T as upstream's conv output is. With S > 1 only the v channels' state shifts here.
  const int C = 2 * K + Rb * V;
  const T* xr = qkv + bi * s_qkv;
  T* cst = conv_state + (int64_t)slot * cs_slot;
  auto channel = [&](int c) {
    return c < K ? h * K + c : (c < 2 * K ? H * K + h * K + (c - K) : 2 * H * K + hv0 * V + (c - 2 * K));
  };
  for (int c = tid; c < C; c += blockDim.x) {
    const int gc = channel(c);
    const float acc = gdn_conv_channel(cst + (int64_t)gc * cs_d, cs_w, conv_w + (int64_t)gc * W,
                                       W, xr[gc], conv_b != nullptr ? to_f(conv_b[gc]) : 0.f,
                                       c >= 2 * K || S == 1);
    sm[c] = to_f(static_cast<T>(silu ? silu_f(acc) : acc));
  }
  __syncthreads();  // every q/k window of this block read
  if (S > 1) {
    if (tid == 0) {
      __threadfence();
      last = atomicAdd(&counts[bi * H + h], 1) == S - 1;
      if (last) counts[bi * H + h] = 0;
    }
    __syncthreads();
    if (last)  // the other S - 1 blocks have read the old q/k windows: shift them (through
               // gdn_conv_channel, its product dropped: one source for the shift)
      for (int c = tid; c < 2 * K; c += blockDim.x) {
        const int gc = channel(c);
        gdn_conv_channel(cst + (int64_t)gc * cs_d, cs_w, conv_w + (int64_t)gc * W, W, xr[gc], 0.f,
                         true);
      }
  }
  // L2 norms of q and k (float32, eps 1e-6), scale folded into q.
  float ss[2] = {0.f, 0.f};
  for (int i = tid; i < K; i += blockDim.x) {
    ss[0] += q[i] * q[i];
    ss[1] += k[i] * k[i];
  }
  block_sum<2>(ss, red);
  const float rq = rsqrtf(ss[0] + 1e-6f) * scale, rk = rsqrtf(ss[1] + 1e-6f);
  for (int i = tid; i < K; i += blockDim.x) {
    q[i] *= rq;
    k[i] *= rk;
  }
  __syncthreads();
  // Delta rule, kGdnRows state rows [K] per group of kGdnGroup lanes and pass:
  //   h <- exp(g) h;  h <- h + beta (v - h.k) k;  o = h.q
  for (int row0 = first; row0 < RV; row0 += groups * kGdnRows) {
    if (row0 != first) gdn_load_rows(hv_rows, st, row0, RV, K, lane);
    const int nr = min(kGdnRows, RV - row0);  // uniform across the group
    float hk[kGdnRows];
#pragma unroll
    for (int u = 0; u < kGdnRows; ++u) {
      const float e = gate[(row0 + (u < nr ? u : 0)) / V];
      hk[u] = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = (j * kGdnGroup + lane) * 4;
        if (col < K) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            hv_rows[u][4 * j + c] *= e;
            hk[u] += hv_rows[u][4 * j + c] * k[col + c];
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kGdnRows; ++u) {
      if (u >= nr) break;
      const int row = row0 + u;
      const float delta = gate[Rb + row / V] * (v[row] - group_sum(hk[u], kGdnGroup));
      float* hr = st + (int64_t)row * K;
      float hq = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = (j * kGdnGroup + lane) * 4;
        if (col < K) {
          float4 t;
          t.x = hv_rows[u][4 * j] + delta * k[col];
          t.y = hv_rows[u][4 * j + 1] + delta * k[col + 1];
          t.z = hv_rows[u][4 * j + 2] + delta * k[col + 2];
          t.w = hv_rows[u][4 * j + 3] + delta * k[col + 3];
          *reinterpret_cast<float4*>(hr + col) = t;
          hq += t.x * q[col] + t.y * q[col + 1] + t.z * q[col + 2] + t.w * q[col + 3];
        }
      }
      hq = group_sum(hq, kGdnGroup);
      if (lane == 0) {
        if (z != nullptr)
          ov[row] = to_f(static_cast<T>(hq));
        else
          o[row] = static_cast<T>(hq);
      }
    }
  }
  if (z == nullptr) return;
  __syncthreads();
  // Gated RMSNorm of each of the block's value heads, one warp per head (any warp width).
  const int wl = tid % warpSize, nw = blockDim.x / warpSize;
  for (int r = tid / warpSize; r < Rb; r += nw) {
    const float* orow = ov + r * V;
    float ss = 0.f;
    for (int i = wl; i < V; i += warpSize) ss += orow[i] * orow[i];
    const float inv = rsqrtf(warp_sum(ss) / V + norm_eps);
    const T* zr = z + bi * s_z0 + (int64_t)(hv0 + r) * s_z1;
    for (int i = wl; i < V; i += warpSize) {
      const float g = to_f(zr[i]);
      o[r * V + i] = static_cast<T>(orow[i] * inv * to_f(norm_w[i]) *
                                    (norm_sigmoid ? sigmoid_f(g) : silu_f(g)));
    }
  }
}

// ------------------------------------------------------------------------------------------
// Decode GEMV: out[m, n] = sum_k x[m, k] W[n, k] for the M <= kGemvMaxRows rows of a decode
// step, W an nn.Linear weight [N, K] (row-major), float32 accumulation, one rounding to T.
// At these M the product is a stream of W; each warp reads kGemvRowsPerWarp of its rows with
// 16-byte loads (x's matching chunks come through L1/L2: every warp reads the same x). Why not
// cuBLAS: each call costs the host ~20 us there against ~12 us for a plain launch (LEDGER,
// "What one eager launch costs the host"), and an eager step makes ~120 of them.
// ------------------------------------------------------------------------------------------

constexpr int kGemvMaxRows = 8;
constexpr int kGemvRowsPerWarp = 2;
// 128 threads, 2 rows a warp: 8 rows a block with 32-lane warps, so a 2K-3K-row projection
// spreads over ~2-3 blocks per H200 SM (its weight streams from HBM: every SM must pull, and
// with 16 rows a block the second wave left half the SMs idle: 1.3 of cuBLAS's GPU time).
constexpr int kGemvBlock = 128;

template <typename T, int M>
__global__ void gemv_kernel(const T* __restrict__ x, int64_t s_x, const T* __restrict__ w,
                            T* __restrict__ out, int N, int K) {
  constexpr int R = kGemvRowsPerWarp, V = Vec<T>::N;
  const int lane = threadIdx.x % warpSize;
  const int warps = blockDim.x / warpSize;
  // Grid-stride over groups of R rows, so the grid need not know the warp width; the loop
  // bound is warp-uniform (no shuffle skipped by part of a warp).
  for (int n0 = (blockIdx.x * warps + threadIdx.x / warpSize) * R; n0 < N;
       n0 += gridDim.x * warps * R) {
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    auto step = [&](int k) {  // this lane's 16-byte chunk at k of each row, times each x row
      Vec<T> wv[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (n0 + r < N) {
          wv[r].load(w + static_cast<int64_t>(n0 + r) * K + k);
        } else {
#pragma unroll
          for (int u = 0; u < V; ++u) wv[r].f[u] = 0.f;
        }
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        Vec<T> xv;
        xv.load(x + m * s_x + k);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int u = 0; u < V; ++u) acc[r][m] += wv[r].f[u] * xv.f[u];
      }
    };
    const int stride = warpSize * V;
#if defined(__NVCC__) && !defined(__clang__)
#pragma unroll 4
    for (int k = lane * V; k < K; k += stride) step(k);
#else
    // Four steps a round by hand, then the rest. The stride is a runtime value (warpSize), and
    // clang 19 left the `#pragma unroll 4` above rolled ("loop not unrolled"; LEDGER): one
    // step's loads in flight at a time. clang (the target's CoreX is one) and the CPU
    // emulation build take this path; nvcc keeps its own unroll (same SASS). Same order of
    // additions as the single loop.
    int k = lane * V;
    for (; k + 3 * stride < K; k += 4 * stride) {
      step(k);
      step(k + stride);
      step(k + 2 * stride);
      step(k + 3 * stride);
    }
    for (; k < K; k += stride) step(k);
#endif
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float v = warp_sum(acc[r][m]);
        if (lane == (r * M + m) % warpSize && n0 + r < N)
          out[static_cast<int64_t>(m) * N + n0 + r] = static_cast<T>(v);
      }
  }
}

// ------------------------------------------------------------------------------------------
// MoE decode experts. Pairs p = (token t, slot j) for the routed experts, then one pair per
// token for the shared expert when present. Kernel 1: act[p] = silu(W1 x) * (W3 x), float32,
// reading the chosen expert's rows in place. Kernel 2: out[t] = sum_j w_j W2[e_j] act[p_j]
// (+ sigmoid(x . g) Ws2 act_shared).
// ------------------------------------------------------------------------------------------

constexpr int kRowsUp = 4;  // gate rows (and as many up rows) per block in kernel 1

// With `logits`, every routed block first routes its token itself (group_topk: the same
// arithmetic as moe_route) and the blocks of column 0 write the pair's weight and expert to
// w_out / ids (which the down kernel reads): one launch fewer per layer.
template <typename T>
__global__ void moe_up_kernel(const T* __restrict__ x, int H, int64_t* __restrict__ ids,
                              int T_, int top_k, const T* __restrict__ w13, int I,
                              const T* __restrict__ sh_w13, int Is,
                              const T* __restrict__ sh_gate, float* __restrict__ act,
                              float* __restrict__ sh_sig, int act_stride,
                              const T* __restrict__ logits, int64_t s_logits, int E,
                              bool renormalize, float* __restrict__ w_out) {
  VO_DYN_SMEM(float, lg);  // E router logits (routing blocks only)
  __shared__ float red[2 * kRowsUp * kMaxWarps];
  __shared__ float gred[kMaxWarps];
  __shared__ float sel_w[64];
  __shared__ int sel_i[64];
  const int p = blockIdx.y;
  const bool shared = p >= T_ * top_k;
  const int t = shared ? p - T_ * top_k : p / top_k;
  const int rows = shared ? Is : I;
  const int i0 = blockIdx.x * kRowsUp;
  const bool need_gate = shared && sh_gate != nullptr && blockIdx.x == 0;
  if (i0 >= rows && !need_gate) return;
  int64_t expert = 0;
  if (!shared && logits != nullptr) {  // block-uniform: the barriers below are safe
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const float v = to_f(logits[t * s_logits + e]);
      lg[e] = v != v ? -INFINITY : v;  // as moe_route
    }
    __syncthreads();
    if (threadIdx.x < warpSize) {  // warp 0 (each of its lane groups computes the same)
      float w;
      int ex;
      group_topk(lg, E, top_k, renormalize, threadIdx.x % kRouteLanes, w, ex);
      if (threadIdx.x < top_k) {
        sel_w[threadIdx.x] = w;
        sel_i[threadIdx.x] = ex;
      }
    }
    __syncthreads();
    expert = sel_i[p % top_k];
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      w_out[p] = sel_w[p % top_k];
      ids[p] = expert;
    }
  } else if (!shared) {
    expert = ids[p];
  }
  const T* W = shared ? sh_w13 : w13 + expert * (int64_t)(2 * I) * H;
  const T* xr = x + (int64_t)t * H;
  constexpr int N = Vec<T>::N;
  float acc[2 * kRowsUp];
#pragma unroll
  for (int r = 0; r < 2 * kRowsUp; ++r) acc[r] = 0.f;
  float g[1] = {0.f};
  for (int c = threadIdx.x * N; c < H; c += blockDim.x * N) {
    Vec<T> xv;
    xv.load(xr + c);
#pragma unroll
    for (int r = 0; r < kRowsUp; ++r) {
      const int i = i0 + r;
      if (i < rows) {
        Vec<T> wg, wu;
        wg.load(W + (int64_t)i * H + c);
        wu.load(W + (int64_t)(rows + i) * H + c);
#pragma unroll
        for (int u = 0; u < N; ++u) {
          acc[r] += wg.f[u] * xv.f[u];
          acc[kRowsUp + r] += wu.f[u] * xv.f[u];
        }
      }
    }
    if (need_gate) {
      Vec<T> gv;
      gv.load(sh_gate + c);
#pragma unroll
      for (int u = 0; u < N; ++u) g[0] += gv.f[u] * xv.f[u];
    }
  }
  block_sum<2 * kRowsUp>(acc, red);
  if (need_gate) {
    block_sum<1>(g, gred);
    if (threadIdx.x == 0) sh_sig[t] = sigmoid_f(g[0]);
  }
  if (threadIdx.x < kRowsUp) {
    const int i = i0 + threadIdx.x;
    // Round the projections to T as the PyTorch path's GEMM output is.
    if (i < rows) {
      float gg = 0.f, uu = 0.f;
#pragma unroll
      for (int r = 0; r < kRowsUp; ++r)
        if (r == (int)threadIdx.x) {
          gg = acc[r];
          uu = acc[kRowsUp + r];
        }
      gg = to_f(static_cast<T>(gg));
      uu = to_f(static_cast<T>(uu));
      act[(int64_t)p * act_stride + i] = silu_f(gg) * uu;
    }
  }
}

constexpr int kRowsDown = 16;  // output rows of H per block in kernel 2 (one per lane group)

template <typename T>
__global__ void moe_down_kernel(const float* __restrict__ act, int act_stride,
                                const float* __restrict__ topk_w,
                                const int64_t* __restrict__ ids, int T_, int top_k,
                                const T* __restrict__ w2, int I, const T* __restrict__ sh_w2,
                                int Is, const float* __restrict__ sh_sig, int H,
                                T* __restrict__ out) {
  VO_DYN_SMEM(float, a_s);  // (top_k + shared) * act_stride, weight folded in
  const int t = blockIdx.y;
  const int npairs = top_k + (sh_w2 != nullptr ? 1 : 0);
  for (int idx = threadIdx.x; idx < npairs * act_stride; idx += blockDim.x) {
    const int j = idx / act_stride, i = idx % act_stride;
    float wgt, val;
    if (j < top_k) {
      wgt = topk_w[t * top_k + j];
      val = i < I ? act[(int64_t)(t * top_k + j) * act_stride + i] : 0.f;
    } else {
      wgt = sh_sig != nullptr ? sh_sig[t] : 1.f;
      val = i < Is ? act[(int64_t)(T_ * top_k + t) * act_stride + i] : 0.f;
    }
    a_s[idx] = wgt * val;
  }
  __syncthreads();
  constexpr int N = Vec<T>::N;
  const int lane = threadIdx.x % kGdnGroup, groups = blockDim.x / kGdnGroup;
  for (int r = blockIdx.x * kRowsDown + threadIdx.x / kGdnGroup;
       r < std::min(H, (int)(blockIdx.x + 1) * kRowsDown); r += groups) {
    float acc = 0.f;
    for (int j = 0; j < npairs; ++j) {
      const bool sh = j >= top_k;
      const int n = sh ? Is : I;
      const T* wr = sh ? sh_w2 + (int64_t)r * Is : w2 + (ids[t * top_k + j] * (int64_t)H + r) * I;
      const float* aj = a_s + j * act_stride;
      for (int c = lane * N; c < n; c += kGdnGroup * N) {
        Vec<T> wv;
        wv.load(wr + c);
#pragma unroll
        for (int u = 0; u < N; ++u) acc += wv.f[u] * aj[c + u];
      }
    }
    acc = group_sum(acc, kGdnGroup);
    if (lane == 0) out[(int64_t)t * H + r] = static_cast<T>(acc);
  }
}

// ------------------------------------------------------------------------------------------
// Gated attention: split + q/k (beta + w) RMSNorm + partial NeoX RoPE (plain or interleaved
// MRoPE) + gate copy, one launch for every head of every token (block per (token, head)).
// The norm output is rounded to T before the rotation, as the unfused path stores it.
// ------------------------------------------------------------------------------------------

template <typename T, typename C>
__global__ void qk_norm_rope_gate_kernel(
    const T* __restrict__ q_gate, int64_t s_qg, const T* __restrict__ k, int64_t s_k,
    const T* __restrict__ q_w, const T* __restrict__ k_w, const C* __restrict__ cache,
    int64_t s_cache, const int64_t* __restrict__ pos, int64_t s_pos_m, int64_t s_pos_t,
    int nq, int D, int rot, int sec_h, int sec_w, float eps, float beta,
    T* __restrict__ q_out, T* __restrict__ k_out, T* __restrict__ gate_out) {
  VO_DYN_SMEM(float, row);  // D floats
  __shared__ float red[kMaxWarps];
  const int64_t t = blockIdx.x;
  const int head = blockIdx.y;
  const bool is_k = head >= nq;
  const int h = is_k ? head - nq : head;
  const T* in = is_k ? k + t * s_k + (int64_t)h * D : q_gate + t * s_qg + (int64_t)h * 2 * D;
  const T* w = is_k ? k_w : q_w;
  const int nkv = static_cast<int>(gridDim.y) - nq;
  T* out = is_k ? k_out + (t * nkv + h) * D : q_out + (t * nq + h) * D;
  float ss[1] = {0.f};
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    const float v = to_f(in[i]);
    row[i] = v;
    ss[0] += v * v;
  }
  block_sum<1>(ss, red);  // its barriers also order the row writes before the reads below
  const float inv = rsqrtf(ss[0] / D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    row[i] = to_f(static_cast<T>(row[i] * inv * (to_f(w[i]) + beta)));
  __syncthreads();
  const int half = rot / 2;
  const int64_t p_t = pos[t * s_pos_t];
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float o = row[i];
    if (i < rot) {
      const int j = i < half ? i : i - half;
      int64_t p = p_t;
      if (j % 3 == 1 && j < 3 * sec_h) p = pos[s_pos_m + t * s_pos_t];
      else if (j % 3 == 2 && j < 3 * sec_w) p = pos[2 * s_pos_m + t * s_pos_t];
      const float c = to_f(cache[p * s_cache + j]), sn = to_f(cache[p * s_cache + half + j]);
      o = i < half ? row[i] * c - row[i + half] * sn : row[i] * c + row[i - half] * sn;
    }
    out[i] = static_cast<T>(o);
  }
  if (!is_k) {
    T* g = gate_out + (t * nq + h) * D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) g[i] = in[D + i];
  }
}

// ------------------------------------------------------------------------------------------
// Host wrappers
// ------------------------------------------------------------------------------------------

// Launches gemma_rms_norm_kernel over the rows of xc (contiguous, like out, rc and res;
// rc / res null without the residual add). Geometry (kernel comment): a lane group per row
// while the row fits in kNormLanes lanes of up to 4 chunks each, else a whole block per row;
// K the fewest chunks per lane (1, 2 or 4) that hold the row, longer rows read twice.
void gemma_rms_norm_launch(const at::Tensor& xc, const at::Tensor* rc, const at::Tensor& w,
                           at::Tensor& out, at::Tensor* res, double eps) {
  const int H = xc.size(-1);
  TORCH_CHECK(w.numel() == H, "gemma_rms_norm: weight [hidden] expected");
  const int64_t rows = H > 0 ? xc.numel() / H : 0;
  if (rows == 0) return;
  // Whole 16-byte vectors: rows of whole vectors and every pointer 16-byte aligned (then so is
  // every row start).
  const int64_t esz = xc.element_size();
  auto aligned = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const bool vec = (H * esz) % 16 == 0 && aligned(xc) && aligned(w) && aligned(out) &&
                   (rc == nullptr || (aligned(*rc) && aligned(*res)));
  const int64_t chunks = vec ? H * esz / 16 : H;
  const int G = chunks <= kNormLanes * kGemmaMaxK ? kNormLanes : kBlock;
  const int64_t need = (chunks + G - 1) / G;
  const int K = need <= 1 ? 1 : (need <= 2 ? 2 : kGemmaMaxK);
  const int per_block = kBlock / G;
  const int64_t grid = (rows + per_block - 1) / per_block;
  VO_DISPATCH_FLOATS(xc.scalar_type(), "gemma_rms_norm", [&] {
    auto go = [&](auto kern) {
      VO_LAUNCH(kern, grid, kBlock, 0, xc.data_ptr<scalar_t>(),
          rc != nullptr ? rc->data_ptr<scalar_t>() : nullptr, w.data_ptr<scalar_t>(),
          out.data_ptr<scalar_t>(), res != nullptr ? res->data_ptr<scalar_t>() : nullptr, rows,
          H, G, static_cast<float>(eps));
    };
    if (vec) {
      if (K == 1) go(gemma_rms_norm_kernel<scalar_t, 1, true>);
      else if (K == 2) go(gemma_rms_norm_kernel<scalar_t, 2, true>);
      else go(gemma_rms_norm_kernel<scalar_t, kGemmaMaxK, true>);
    } else {
      if (K == 1) go(gemma_rms_norm_kernel<scalar_t, 1, false>);
      else if (K == 2) go(gemma_rms_norm_kernel<scalar_t, 2, false>);
      else go(gemma_rms_norm_kernel<scalar_t, kGemmaMaxK, false>);
    }
  });
}

at::Tensor gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(VO_ON_DEVICE(x) && VO_ON_DEVICE(weight), "gemma_rms_norm: CUDA tensors expected");
  VO_DEVICE_GUARD(x);
  auto xc = x.contiguous();
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = at::empty_like(xc);
  gemma_rms_norm_launch(xc, nullptr, w, out, nullptr, eps);
  return out;
}

std::tuple<at::Tensor, at::Tensor> gemma_fused_add_rms_norm(const at::Tensor& x,
                                                            const at::Tensor& residual,
                                                            const at::Tensor& weight,
                                                            double eps) {
  TORCH_CHECK(VO_ON_DEVICE(x) && VO_ON_DEVICE(residual), "gemma_fused_add_rms_norm: CUDA tensors");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual shapes differ");
  VO_DEVICE_GUARD(x);
  auto xc = x.contiguous();
  auto rc = residual.to(x.scalar_type()).contiguous();
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = at::empty_like(xc);
  auto res = at::empty_like(xc);
  gemma_rms_norm_launch(xc, &rc, w, out, &res, eps);
  return {out, res};
}

at::Tensor rms_norm_gated(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                          double eps, bool sigmoid_gate) {
  TORCH_CHECK(VO_ON_DEVICE(x) && VO_ON_DEVICE(z), "rms_norm_gated: CUDA tensors expected");
  TORCH_CHECK(x.sizes() == z.sizes() && x.scalar_type() == z.scalar_type(),
              "rms_norm_gated: x and z differ");
  VO_DEVICE_GUARD(x);
  const int V = x.size(-1);
  // View both as [T, HV, V] with unit stride on V.
  auto as3 = [&](const at::Tensor& t) {
    at::Tensor u = t.stride(-1) == 1 ? t : t.contiguous();
    if (u.dim() == 1) return u.view({1, 1, V});
    if (u.dim() == 2) return u.unsqueeze(0);
    if (u.dim() == 3) return u;
    return u.reshape({-1, u.size(-2), V});
  };
  auto x3 = as3(x), z3 = as3(z);
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = at::empty(x.sizes(), x.options());
  const int64_t n = x3.size(0) * x3.size(1);
  if (n == 0) return out;
  // Whole 16-byte vectors: every row start (and the weight) 16-byte aligned.
  const int64_t esz = x.element_size();
  auto aligned = [&](const at::Tensor& t, int64_t s0, int64_t s1) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (s0 * esz) % 16 == 0 &&
           (s1 * esz) % 16 == 0;
  };
  const bool vec = (V * esz) % 16 == 0 && aligned(x3, x3.stride(0), x3.stride(1)) &&
                   aligned(z3, z3.stride(0), z3.stride(1)) && aligned(w, 0, 0);
  const int per_block = kBlock / kNormLanes;
  VO_DISPATCH_FLOATS(x.scalar_type(), "rms_norm_gated", [&] {
    VO_LAUNCH(rms_norm_gated_kernel<scalar_t>, (n + per_block - 1) / per_block, kBlock, 0,
        x3.data_ptr<scalar_t>(), z3.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
        out.data_ptr<scalar_t>(), n, x3.size(1), V, x3.stride(0), x3.stride(1), z3.stride(0),
        z3.stride(1), static_cast<float>(eps), sigmoid_gate, vec);
  });
  return out;
}

template <typename T, int M>
void gemv_launch(dim3 grid, const T* x, int64_t s_x, const T* w, T* out, int N, int K) {
  VO_LAUNCH((gemv_kernel<T, M>), grid, kGemvBlock, 0, x, s_x, w, out, N, K);
}

template <typename T>
void gemv_dispatch(int M, dim3 grid, const T* x, int64_t s_x, const T* w, T* out, int N, int K) {
  switch (M) {
    case 1: gemv_launch<T, 1>(grid, x, s_x, w, out, N, K); break;
    case 2: gemv_launch<T, 2>(grid, x, s_x, w, out, N, K); break;
    case 3: gemv_launch<T, 3>(grid, x, s_x, w, out, N, K); break;
    case 4: gemv_launch<T, 4>(grid, x, s_x, w, out, N, K); break;
    case 5: gemv_launch<T, 5>(grid, x, s_x, w, out, N, K); break;
    case 6: gemv_launch<T, 6>(grid, x, s_x, w, out, N, K); break;
    case 7: gemv_launch<T, 7>(grid, x, s_x, w, out, N, K); break;
    default: gemv_launch<T, 8>(grid, x, s_x, w, out, N, K); break;
  }
}

// x [M, K] @ W[N, K]^T for the rows of a decode step (gemv_kernel); anything it does not take
// (more rows, a dtype or layout without 16-byte vectors) goes to at::linear, so a caller needs
// no checks of its own.
// Whether gemv_kernel takes (x, weight); the test op dense_linear_takes reports it.
bool dense_linear_takes(const at::Tensor& x, const at::Tensor& weight) {
  if (x.dim() != 2 || weight.dim() != 2 || x.size(1) != weight.size(1)) return false;
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  return M >= 1 && M <= kGemvMaxRows && x.scalar_type() == weight.scalar_type() &&
         (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) &&
         x.stride(1) == 1 && weight.is_contiguous() && K % 8 == 0 &&
         (M == 1 || x.stride(0) % 8 == 0) &&
         reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0 && N < (1 << 30) &&
         VO_ON_DEVICE(x) && x.device() == weight.device();
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) {
  if (!dense_linear_takes(x, weight)) return at::linear(x, weight);
  const int64_t M = x.size(0), N = weight.size(0), K = x.size(1);
  VO_DEVICE_GUARD(x);
  auto out = at::empty({M, N}, x.options());
  // Sized for 32-lane warps; with wider warps each warp takes more row groups.
  const int rows_per_block = (kGemvBlock / 32) * kGemvRowsPerWarp;
  const dim3 grid(static_cast<unsigned>((N + rows_per_block - 1) / rows_per_block));
  VO_DISPATCH_FLOATS(x.scalar_type(), "dense_linear", [&] {
    gemv_dispatch<scalar_t>(static_cast<int>(M), grid, x.data_ptr<scalar_t>(), x.stride(0),
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            static_cast<int>(N), static_cast<int>(K));
  });
  return out;
}

// gdn_decode_kernel's per-(sequence, key head) counts: zero between calls (each call's last
// block resets what it counted), so one buffer per device serves every layer and call, in
// stream order. Allocated on first use (the engine's warm-up runs precede any graph capture);
// the growth is a guard only: the shared-window split runs while B x HV <= the SM count, so
// the B x H ints it counts stay far below the first allocation's 4,096.
int* gdn_decode_counts(const at::Tensor& like, int64_t n) {
  static std::mutex mu;
  static std::map<int, at::Tensor> bufs;
  std::lock_guard<std::mutex> lock(mu);
  at::Tensor& buf = bufs[like.is_cpu() ? -1 : like.get_device()];
  if (!buf.defined() || buf.numel() < n)
    buf = at::zeros({std::max<int64_t>(n, 4096)}, like.options().dtype(at::kInt));
  return buf.data_ptr<int>();
}

void gdn_decode(const at::Tensor& qkv, const at::Tensor& a, const at::Tensor& b,
                at::Tensor& conv_state, const at::Tensor& conv_weight,
                const c10::optional<at::Tensor>& conv_bias, const at::Tensor& A_log,
                const at::Tensor& dt_bias, at::Tensor& ssm_state, at::Tensor& out,
                const at::Tensor& slots, int64_t num_k_heads, double scale, bool silu,
                const c10::optional<at::Tensor>& z, const c10::optional<at::Tensor>& norm_weight,
                double norm_eps, bool norm_sigmoid) {
  TORCH_CHECK(VO_ON_DEVICE(qkv) && VO_ON_DEVICE(ssm_state), "gdn_decode: CUDA tensors expected");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "gdn_decode: qkv [B, D], unit stride");
  TORCH_CHECK(ssm_state.scalar_type() == at::kFloat && ssm_state.dim() == 4 &&
                  ssm_state.stride(3) == 1 && ssm_state.stride(2) == ssm_state.size(3) &&
                  ssm_state.stride(1) == ssm_state.size(2) * ssm_state.size(3),
              "gdn_decode: float32 ssm_state [slots, HV, V, K], contiguous within a slot");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(ssm_state.data_ptr()) % 16 == 0 &&
                  (ssm_state.stride(0) * 4) % 16 == 0,
              "gdn_decode: ssm_state rows must allow 16-byte loads");
  TORCH_CHECK(conv_state.scalar_type() == qkv.scalar_type() &&
                  out.scalar_type() == qkv.scalar_type(),
              "gdn_decode: conv_state/out dtype must match qkv");
  TORCH_CHECK(conv_weight.is_contiguous() && conv_weight.dim() == 2, "conv_weight [D, W]");
  TORCH_CHECK(A_log.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat,
              "gdn_decode: float32 A_log / dt_bias");
  TORCH_CHECK(slots.scalar_type() == at::kInt, "gdn_decode: int32 slots");
  TORCH_CHECK(a.stride(-1) == 1 && b.stride(-1) == 1, "gdn_decode: a, b unit stride");
  const int B = qkv.size(0);
  if (B == 0) return;
  const int HV = ssm_state.size(1), V = ssm_state.size(2), K = ssm_state.size(3);
  const int H = static_cast<int>(num_k_heads);
  const int W = conv_weight.size(1);
  TORCH_CHECK(HV % H == 0 && K % 4 == 0 && K <= 8 * kGdnGroup && W >= 2,
              "gdn_decode: needs HV % H == 0, K % 4 == 0, K <= 128, conv width >= 2");
  TORCH_CHECK(qkv.size(1) == 2 * H * K + HV * V, "gdn_decode: qkv width != 2HK + HV*V");
  TORCH_CHECK(out.size(0) >= B && out.stride(-1) == 1 && out.stride(-2) == V,
              "gdn_decode: out [B, HV, V] with contiguous heads");
  const bool norm = z.has_value();
  TORCH_CHECK(norm == norm_weight.has_value(), "gdn_decode: z and norm_weight go together");
  if (norm) {
    TORCH_CHECK(z->scalar_type() == qkv.scalar_type() && z->dim() == 3 && z->size(0) >= B &&
                    z->size(1) == HV && z->size(2) == V && z->stride(2) == 1,
                "gdn_decode: z [B, HV, V] with a unit last stride");
    TORCH_CHECK(norm_weight->scalar_type() == qkv.scalar_type() &&
                    norm_weight->is_contiguous() && norm_weight->numel() == V,
                "gdn_decode: norm_weight [V] in the activation dtype");
  }
  VO_DEVICE_GUARD(qkv);
  // Value heads per block: one while that grid fits one wave of the GPU's SMs, else a key
  // head's R (H200: one head a block took B = 1 from 10.7 to 8.5 us but B = 64 from 30 to 38).
  const int R = HV / H, Rb = (int64_t)B * HV <= VO_SM_COUNT(qkv) ? 1 : R;
  const size_t smem = (2 * K + Rb * V + 2 * Rb + (norm ? Rb * V : 0)) * sizeof(float);
  dim3 grid(HV / Rb, B);
  int* counts = Rb < R ? gdn_decode_counts(qkv, (int64_t)B * H) : nullptr;
  VO_DISPATCH_FLOATS(qkv.scalar_type(), "gdn_decode", [&] {
    const scalar_t* bias = conv_bias.has_value() ? conv_bias->data_ptr<scalar_t>() : nullptr;
    if (conv_bias.has_value())
      TORCH_CHECK(conv_bias->scalar_type() == qkv.scalar_type() && conv_bias->is_contiguous(),
                  "gdn_decode: conv_bias dtype");
    TORCH_CHECK(conv_weight.scalar_type() == qkv.scalar_type(), "gdn_decode: conv_weight dtype");
    VO_LAUNCH(gdn_decode_kernel<scalar_t>, grid, kGdnBlock, smem,
        qkv.data_ptr<scalar_t>(), qkv.stride(0), a.data_ptr<scalar_t>(), a.stride(0),
        b.data_ptr<scalar_t>(), b.stride(0), conv_state.data_ptr<scalar_t>(),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        conv_weight.data_ptr<scalar_t>(), bias, W, A_log.data_ptr<float>(),
        dt_bias.data_ptr<float>(), ssm_state.data_ptr<float>(), ssm_state.stride(0),
        out.data_ptr<scalar_t>(), out.stride(0), slots.data_ptr<int32_t>(), H, HV, K, V,
        static_cast<float>(scale), silu, norm ? z->data_ptr<scalar_t>() : nullptr,
        norm ? z->stride(0) : 0, norm ? z->stride(1) : 0,
        norm ? norm_weight->data_ptr<scalar_t>() : nullptr, static_cast<float>(norm_eps),
        norm_sigmoid, Rb, counts);
  });
}

// Routed experts of a few tokens (+ the shared expert): from the routing (topk_w, topk_ids),
// or, with `logits`, routing inside the up kernel (topk_w / topk_ids are then outputs).
at::Tensor moe_decode_impl(const at::Tensor& x, at::Tensor tw, at::Tensor ids,
                           const c10::optional<at::Tensor>& logits, int64_t top_k,
                           bool renormalize, const at::Tensor& w13, const at::Tensor& w2,
                           const c10::optional<at::Tensor>& sh_w13,
                           const c10::optional<at::Tensor>& sh_w2,
                           const c10::optional<at::Tensor>& sh_gate) {
  TORCH_CHECK(VO_ON_DEVICE(x) && x.dim() == 2 && x.is_contiguous(), "moe_decode: x [T, H]");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "moe_decode: contiguous weights");
  TORCH_CHECK(tw.scalar_type() == at::kFloat, "moe_decode: float32 weights");
  const int T = x.size(0), H = x.size(1), k = static_cast<int>(top_k);
  const int I = w2.size(2), E = w13.size(0);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(1) == H, "moe_decode: shapes");
  TORCH_CHECK(tw.size(0) == T && tw.size(1) == k && ids.sizes() == tw.sizes(),
              "moe_decode: routing [T, top_k]");
  if (logits.has_value())
    TORCH_CHECK(logits->dim() == 2 && logits->size(0) == T && logits->size(1) == E &&
                    logits->stride(1) == 1 && logits->scalar_type() == x.scalar_type() &&
                    E <= 1024 && k >= 1 && k <= std::min(E, kRouteLanes),
                "moe_decode_routed: logits [T, E] like x, unit stride, E <= 1024, top_k <= 16");
  const bool has_sh = sh_w13.has_value() && sh_w2.has_value();
  const int Is = has_sh ? sh_w2->size(1) : 0;
  if (has_sh)
    TORCH_CHECK(sh_w13->size(0) == 2 * Is && sh_w13->size(1) == H && sh_w2->size(0) == H &&
                    sh_w13->is_contiguous() && sh_w2->is_contiguous() &&
                    (!sh_gate.has_value() || (sh_gate->numel() == H && sh_gate->is_contiguous())),
                "moe_decode: shared expert shapes (contiguous)");
  const int vec = 16 / x.element_size();
  TORCH_CHECK(H % vec == 0 && I % vec == 0 && Is % vec == 0, "moe_decode: H, I % 16 bytes");
  VO_DEVICE_GUARD(x);
  auto out = at::empty_like(x);
  if (T == 0) return out;
  const int act_stride = std::max(I, Is);
  const int P = T * k + (has_sh ? T : 0);
  // One scratch allocation (activations, then the shared gate's sigmoids): eager decode pays
  // host time per allocation.
  auto scratch = at::empty({(int64_t)P * act_stride + T}, x.options().dtype(at::kFloat));
  float* act = scratch.data_ptr<float>();
  float* sig = act + (int64_t)P * act_stride;
  const bool has_gate = has_sh && sh_gate.has_value();
  VO_DISPATCH_FLOATS(x.scalar_type(), "moe_decode", [&] {
    using T_ = scalar_t;
    dim3 g1((act_stride + kRowsUp - 1) / kRowsUp, P);
    VO_LAUNCH(moe_up_kernel<T_>, g1, kBlock, logits.has_value() ? E * sizeof(float) : 0,
        x.data_ptr<T_>(), H, ids.data_ptr<int64_t>(), T, k, w13.data_ptr<T_>(), I,
        has_sh ? sh_w13->data_ptr<T_>() : nullptr, Is,
        has_gate ? sh_gate->data_ptr<T_>() : nullptr, act, sig, act_stride,
        logits.has_value() ? logits->data_ptr<T_>() : nullptr,
        logits.has_value() ? logits->stride(0) : 0, E, renormalize, tw.data_ptr<float>());
    dim3 g2((H + kRowsDown - 1) / kRowsDown, T);
    const size_t smem = (k + (has_sh ? 1 : 0)) * act_stride * sizeof(float);
    VO_LAUNCH(moe_down_kernel<T_>, g2, kBlock, smem,
        act, act_stride, tw.data_ptr<float>(), ids.data_ptr<int64_t>(), T, k,
        w2.data_ptr<T_>(), I, has_sh ? sh_w2->data_ptr<T_>() : nullptr, Is,
        has_gate ? sig : nullptr, H, out.data_ptr<T_>());
  });
  return out;
}

at::Tensor moe_decode(const at::Tensor& x, const at::Tensor& topk_w, const at::Tensor& topk_ids,
                      const at::Tensor& w13, const at::Tensor& w2,
                      const c10::optional<at::Tensor>& sh_w13,
                      const c10::optional<at::Tensor>& sh_w2,
                      const c10::optional<at::Tensor>& sh_gate) {
  TORCH_CHECK(topk_ids.dim() == 2, "moe_decode: topk_ids [T, top_k]");
  // The up kernel only reads ids here; the copy is a no-op for int64 contiguous ids.
  return moe_decode_impl(x, topk_w.contiguous(), topk_ids.to(at::kLong).contiguous(),
                         c10::nullopt, topk_ids.size(1), true, w13, w2, sh_w13, sh_w2, sh_gate);
}

// Routing + routed (+ shared) experts in two launches; also returns the routing.
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_decode_routed(
    const at::Tensor& x, const at::Tensor& logits, int64_t top_k, bool renormalize,
    const at::Tensor& w13, const at::Tensor& w2, const c10::optional<at::Tensor>& sh_w13,
    const c10::optional<at::Tensor>& sh_w2, const c10::optional<at::Tensor>& sh_gate) {
  auto tw = at::empty({x.size(0), top_k}, x.options().dtype(at::kFloat));
  auto ids = at::empty({x.size(0), top_k}, x.options().dtype(at::kLong));
  auto out = moe_decode_impl(x, tw, ids, logits, top_k, renormalize, w13, w2, sh_w13, sh_w2,
                             sh_gate);
  return {out, tw, ids};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_norm_rope_gate(
    const at::Tensor& q_gate, const at::Tensor& k, const at::Tensor& q_weight,
    const at::Tensor& k_weight, const at::Tensor& cos_sin_cache, const at::Tensor& positions,
    double eps, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
    int64_t mrope_h, int64_t mrope_w, double norm_beta) {
  TORCH_CHECK(VO_ON_DEVICE(q_gate) && VO_ON_DEVICE(k) && VO_ON_DEVICE(cos_sin_cache),
              "qk_norm_rope_gate: CUDA tensors expected");
  TORCH_CHECK(q_gate.dim() == 2 && k.dim() == 2 && q_gate.stride(1) == 1 && k.stride(1) == 1 &&
                  q_gate.scalar_type() == k.scalar_type(),
              "qk_norm_rope_gate: q_gate [T, 2*nq*D], k [T, nkv*D], unit last stride, one dtype");
  const int64_t T = q_gate.size(0);
  const int nq = num_q_heads, nkv = num_kv_heads, D = head_dim, rot = rotary_dim;
  TORCH_CHECK(q_gate.size(1) == 2 * nq * D && k.size(1) == nkv * D && k.size(0) == T,
              "qk_norm_rope_gate: widths");
  TORCH_CHECK(rot > 0 && rot % 2 == 0 && rot <= D && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.size(1) >= rot && cos_sin_cache.stride(1) == 1,
              "qk_norm_rope_gate: rotary_dim even, <= head_dim, cache [P, rotary_dim]");
  TORCH_CHECK(positions.dim() == 1 || (positions.dim() == 2 && positions.size(0) == 3),
              "qk_norm_rope_gate: positions [T] or [3, T]");
  TORCH_CHECK(positions.size(-1) == T, "qk_norm_rope_gate: positions length");
  TORCH_CHECK(positions.dim() == 2 || (mrope_h == 0 && mrope_w == 0),
              "qk_norm_rope_gate: MRoPE sections need [3, T] positions");
  VO_DEVICE_GUARD(q_gate);
  auto pos = positions.to(at::kLong);
  auto qw = q_weight.to(q_gate.scalar_type()).contiguous();
  auto kw = k_weight.to(q_gate.scalar_type()).contiguous();
  auto cache = cos_sin_cache;
  if (cache.scalar_type() != at::kFloat && cache.scalar_type() != q_gate.scalar_type())
    cache = cache.to(at::kFloat);
  auto q_out = at::empty({T, nq * D}, q_gate.options());
  auto k_out = at::empty({T, nkv * D}, q_gate.options());
  auto gate_out = at::empty({T, nq * D}, q_gate.options());
  if (T == 0) return {q_out, k_out, gate_out};
  const int64_t s_pos_m = pos.dim() == 2 ? pos.stride(0) : 0, s_pos_t = pos.stride(-1);
  const int threads = D <= 128 ? 64 : 128;
  dim3 grid(T, nq + nkv);
  VO_DISPATCH_FLOATS(q_gate.scalar_type(), "qk_norm_rope_gate", [&] {
    using T_ = scalar_t;
    auto launch = [&](auto* cache_ptr) {
      using C_ = std::remove_const_t<std::remove_pointer_t<decltype(cache_ptr)>>;
      auto kfn = qk_norm_rope_gate_kernel<T_, C_>;
      VO_LAUNCH(kfn, grid, threads, D * sizeof(float),
          q_gate.data_ptr<T_>(), q_gate.stride(0), k.data_ptr<T_>(), k.stride(0),
          qw.data_ptr<T_>(), kw.data_ptr<T_>(), cache_ptr, cache.stride(0),
          pos.data_ptr<int64_t>(), s_pos_m, s_pos_t, nq, D, rot, static_cast<int>(mrope_h),
          static_cast<int>(mrope_w), static_cast<float>(eps), static_cast<float>(norm_beta),
          q_out.data_ptr<T_>(), k_out.data_ptr<T_>(), gate_out.data_ptr<T_>());
    };
    if (cache.scalar_type() == at::kFloat) launch(cache.data_ptr<float>());
    else launch(cache.data_ptr<T_>());
  });
  return {q_out, k_out, gate_out};
}

}  // namespace

TORCH_LIBRARY(vo_kernels, m) {
  m.def("gemma_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("gemma_fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps)"
        " -> (Tensor, Tensor)");
  m.def("rms_norm_gated(Tensor x, Tensor z, Tensor weight, float eps, bool sigmoid) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("dense_linear_takes(Tensor x, Tensor weight) -> bool");
  m.def("gdn_decode(Tensor qkv, Tensor a, Tensor b, Tensor(a!) conv_state, Tensor conv_weight,"
        " Tensor? conv_bias, Tensor A_log, Tensor dt_bias, Tensor(b!) ssm_state,"
        " Tensor(c!) out, Tensor slots, int num_k_heads, float scale, bool silu,"
        " Tensor? z=None, Tensor? norm_weight=None, float norm_eps=1e-6,"
        " bool norm_sigmoid=False) -> ()");
  m.def("moe_decode(Tensor x, Tensor topk_w, Tensor topk_ids, Tensor w13, Tensor w2,"
        " Tensor? sh_w13, Tensor? sh_w2, Tensor? sh_gate) -> Tensor");
  m.def("moe_decode_routed(Tensor x, Tensor logits, int top_k, bool renormalize, Tensor w13,"
        " Tensor w2, Tensor? sh_w13, Tensor? sh_w2, Tensor? sh_gate) -> (Tensor, Tensor, Tensor)");
  m.def("qk_norm_rope_gate(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight,"
        " Tensor cos_sin_cache, Tensor positions, float eps, int num_q_heads, int num_kv_heads,"
        " int head_dim, int rotary_dim, int mrope_h, int mrope_w, float norm_beta)"
        " -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vo_kernels, VO_DISPATCH_KEY, m) {
  m.impl("gemma_rms_norm", &gemma_rms_norm);
  m.impl("gemma_fused_add_rms_norm", &gemma_fused_add_rms_norm);
  m.impl("rms_norm_gated", &rms_norm_gated);
  m.impl("gdn_decode", &gdn_decode);
  m.impl("dense_linear", &dense_linear);
  m.impl("dense_linear_takes", &dense_linear_takes);
  m.impl("moe_decode", &moe_decode);
  m.impl("moe_decode_routed", &moe_decode_routed);
  m.impl("qk_norm_rope_gate", &qk_norm_rope_gate);
}
