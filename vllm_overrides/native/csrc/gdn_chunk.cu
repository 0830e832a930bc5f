// Fused GDN chunk prefill kernels (vllm_overrides.native.kernels.chunk_gated_delta_rule).
//
// The chunked (WY) gated delta rule over packed varlen sequences, chunk size C = 64, in three
// launches after a one-thread one that turns cu_seqlens into per-sequence chunk offsets on the
// device (no host sync):
//
//   (a) gdn_chunk_prep_kernel, one block per (chunk slot, value head):
//         G = in-chunk cumsum(g);  A = strict_lower(beta_i exp(G_i - G_j) k_i.k_j);
//         T = (I + A)^-1 (forward substitution in shared memory);
//         W = T (beta exp(G) k),  U = T (beta v),  K~_j = exp(G_last - G_j) k_j
//                                                         -> float32 scratch
//   (b) gdn_chunk_state_kernel, one block per (sequence, value head, slice of V rows),
//       walking that sequence's chunks in order:
//         store h (the state entering the chunk);  v' = U - W h^T (written over U);
//         h = exp(G_last) h + v'^T K~;  the last h -> the final state
//   (c) gdn_chunk_output_kernel, one block per (chunk slot, value head):
//         o = exp(G) (q h^T) scale + (lower(Gamma) * q k^T scale) v'
//
// The math is gdn.chunk_gated_delta_rule's (see its docstring); the state is vLLM's [V, K]
// layout. Every product is a float32 FMA loop over shared-memory tiles (no tensor cores yet)
// in which a thread keeps one output column for several rows in registers, so each operand
// element it loads feeds several FMAs (the other operand is a broadcast); every tile keeps a
// +1 float row pad so column walks hit distinct banks. Shared memory stays
// below 48 KB for K, V <= 128 (no opt-in attribute needed on any card). Chunk slots are an
// upper bound (T / C + N) known from shapes, so the grid needs no host sync; slots past the
// real chunk count return at once. Padded rows of a sequence's last chunk carry g = 0,
// beta = 0, k = 0: they write nothing and decay nothing.
//
// Portability as in common.cuh: no warp size assumed (per-row reductions use group_sum over
// blockDim / C lanes, a power of two <= 16), block size kBlock (a multiple of 64), float32
// accumulation, no float64 on the device.
#include "common.cuh"

// The kernels are written for exactly kBlock threads (per-thread accumulator counts are
// compile-time); telling the compiler lets it budget registers for that block size.
#ifdef VO_CPU_EMULATION
#define VO_GDN_BOUNDS
#else
#define VO_GDN_BOUNDS __launch_bounds__(kBlock)
#endif

namespace {

constexpr int kChunk = 64;  // C: tokens per chunk (vLLM / FLA use 64 too)
constexpr int kTile = 32;   // K-dimension (or row) tile of the shared-memory products
constexpr int kMaxDim = 128;  // K, V <= 128 (Qwen3.5 / 3.6 heads are 128)
constexpr int kMaxVSplit = 16;  // rows of V per state-pass block, at most (smem < 48 KB)
// Per-thread accumulator counts (outputs of a C x C, C x V, ... product spread over the block).
constexpr int kAccCC = kChunk * kChunk / kBlock;
constexpr int kAccCD = kChunk * kMaxDim / kBlock;
constexpr int kAccCS = (kChunk * kMaxVSplit + kBlock - 1) / kBlock;
constexpr int kAccSK = (kMaxVSplit * kMaxDim + kBlock - 1) / kBlock;
static_assert(kBlock % kChunk == 0 && kBlock / kChunk <= 16 && kBlock % kMaxDim == 0,
              "row groups need C | block, and K, V <= 128 must divide the block");

// The chunk slot -> (sequence, first token, rows) mapping. `offs` [N+1] are cumulative chunk
// counts; returns false for a slot past the last chunk.
struct ChunkPos {
  int seq;
  int64_t start;
  int len;
};

__device__ __forceinline__ bool chunk_pos(const int64_t* __restrict__ cu,
                                          const int64_t* __restrict__ offs, int N, int64_t c,
                                          ChunkPos& p) {
  if (c >= offs[N]) return false;
  // Largest s with offs[s] <= c (empty sequences share an offset with their successor; the
  // last such s is the one that owns chunk c).
  int lo = 0, hi = N;  // offs[lo] <= c < offs[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offs[mid] <= c) lo = mid;
    else hi = mid;
  }
  p.seq = lo;
  p.start = cu[lo] + (c - offs[lo]) * kChunk;
  const int64_t rest = cu[lo + 1] - p.start;
  p.len = static_cast<int>(rest < kChunk ? rest : kChunk);
  return true;
}

// Per-row factor of the chunk's rows of one head: rsqrt(|x|^2 + 1e-6) with the l2 norm, else
// 1 (rows past `len` get 0 either way). blockDim / C lanes per row.
template <typename T>
__device__ __forceinline__ void row_factors(const T* __restrict__ x, int64_t row_stride,
                                            int len, int D, bool l2, float* __restrict__ out) {
  const int lpr = blockDim.x / kChunk;
  const int row = threadIdx.x / lpr, lane = threadIdx.x % lpr;
  float ss = 0.f;
  if (l2 && row < len)
    for (int d = lane; d < D; d += lpr) {
      const float e = to_f(x[row * row_stride + d]);
      ss += e * e;
    }
  if (l2) ss = group_sum(ss, lpr);  // every thread takes part (uniform branch)
  if (lane == 0) out[row] = row < len ? (l2 ? rsqrtf(ss + 1e-6f) : 1.f) : 0.f;
}

// In-chunk cumulative log-decay of rows [0, len) (padded rows repeat the last value) and the
// gate rows (beta, 0 past len). The C loads go out in parallel; thread 0 then walks the 64
// partial sums in shared memory (cheaper than a scan's barriers). Valid after a barrier.
__device__ __forceinline__ void chunk_gates(const float* __restrict__ g,
                                            const float* __restrict__ beta, int64_t start,
                                            int len, int HV, int hv, float* __restrict__ G,
                                            float* __restrict__ B) {
  const int i = threadIdx.x;
  if (i < kChunk) {
    G[i] = i < len ? g[(start + i) * HV + hv] : 0.f;
    B[i] = i < len ? beta[(start + i) * HV + hv] : 0.f;
  }
  __syncthreads();
  if (i == 0)
    for (int r = 1; r < kChunk; ++r) G[r] += G[r - 1];
}

// tile[r][0..cols) = scale[r0 + r] * src row (r0 + r), column offset c0, for `rows` rows
// (rows at or past len are zero; no scale: 1). Row pitch cols + 1.
template <typename T>
__device__ __forceinline__ void load_tile(float* __restrict__ tile, const T* __restrict__ src,
                                          int64_t row_stride, int r0, int rows, int c0, int cols,
                                          int len, const float* __restrict__ scale) {
  for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
    const int r = e / cols, c = e % cols, i = r0 + r;
    const float f = scale != nullptr ? scale[i] : 1.f;
    tile[r * (cols + 1) + c] = i < len ? to_f(src[i * row_stride + c0 + c]) * f : 0.f;
  }
}

// acc[r] = sum_d a_i[d] b_j[d] over the chunk rows of two heads (scaled per row by sa / sb,
// rows past len 0), j = tid % C, i = tid / C + r * (kBlock / C): a thread keeps one column j,
// so each b element it loads from shared memory feeds kAccCC FMAs (the a element is the same
// for the whole row group: a broadcast). K streamed in tiles of kTile; both triangles are
// computed (uniform work, no divergence) and the caller masks.
template <typename T>
__device__ __forceinline__ void gram_tiles(float (&acc)[kAccCC], float* ta, float* tb,
                                           const T* __restrict__ a, const T* __restrict__ b,
                                           int64_t stride, int len, int K,
                                           const float* __restrict__ sa,
                                           const float* __restrict__ sb) {
  constexpr int C = kChunk;
  const int j = threadIdx.x % C, i0 = threadIdx.x / C;
#pragma unroll
  for (int r = 0; r < kAccCC; ++r) acc[r] = 0.f;
  for (int k0 = 0; k0 < K; k0 += kTile) {
    __syncthreads();  // the previous tile is consumed
    load_tile(ta, a, stride, 0, C, k0, kTile, len, sa);
    if (tb != ta) load_tile(tb, b, stride, 0, C, k0, kTile, len, sb);
    __syncthreads();
    for (int d = 0; d < kTile; ++d) {
      const float y = tb[j * (kTile + 1) + d];
#pragma unroll
      for (int r = 0; r < kAccCC; ++r) acc[r] += ta[(i0 + r * (kBlock / C)) * (kTile + 1) + d] * y;
    }
  }
}

// o[r] += sum_m M[i][m] x_m[d] over the C rows x_m (scaled by sx[m], rows past len 0) of a head,
// streamed in row tiles of kTile; M is a [C, C] shared-memory matrix with row pitch ldm,
// d = tid % D, i = tid / D + r * (kBlock / D) (kBlock % D == 0). Each x element loaded feeds
// C * D / kBlock FMAs. Accumulates into o.
template <typename T>
__device__ __forceinline__ void rows_times_tiles(float (&o)[kAccCD], const float* M, int ldm,
                                                 float* tile, const T* __restrict__ x,
                                                 int64_t stride, int len, int D,
                                                 const float* __restrict__ sx) {
  constexpr int C = kChunk;
  const int d = threadIdx.x % D, i0 = threadIdx.x / D, nr = C * D / kBlock;
  for (int m0 = 0; m0 < C; m0 += kTile) {
    __syncthreads();
    load_tile(tile, x, stride, m0, kTile, 0, D, len, sx);
    __syncthreads();
    for (int m = 0; m < kTile; ++m) {
      const float y = tile[m * (D + 1) + d];
#pragma unroll
      for (int r = 0; r < kAccCD; ++r)
        if (r < nr) o[r] += M[(i0 + r * (kBlock / D)) * ldm + m0 + m] * y;
    }
  }
}

// dst [C, D] (global) = Tm x, x the chunk rows of a head scaled by sx (rows past len 0),
// streamed in row tiles of kTile, the result in registers. Rows of Tm past len are 0, so are
// those of dst.
template <typename T>
__device__ __forceinline__ void tri_apply(const float* Tm, float* tile, const T* __restrict__ x,
                                          int64_t stride, int len, int D,
                                          const float* __restrict__ sx,
                                          float* __restrict__ dst) {
  float o[kAccCD];
#pragma unroll
  for (int r = 0; r < kAccCD; ++r) o[r] = 0.f;
  rows_times_tiles(o, Tm, kChunk + 1, tile, x, stride, len, D, sx);
  const int d = threadIdx.x % D, i0 = threadIdx.x / D, nr = kChunk * D / kBlock;
#pragma unroll
  for (int r = 0; r < kAccCD; ++r)
    if (r < nr) dst[(i0 + r * (kBlock / D)) * D + d] = o[r];
}

// ------------------------------------------------------------------------------------------
// (a) intra-chunk: G, T = (I + A)^-1, W, U
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void VO_GDN_BOUNDS gdn_chunk_prep_kernel(
    const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ g,
    const float* __restrict__ beta, const int64_t* __restrict__ cu,
    const int64_t* __restrict__ offs, int N, int H, int HV, int K, int V, bool l2,
    float* __restrict__ Gout, float* __restrict__ Wout, float* __restrict__ Uout,
    float* __restrict__ Ktout) {
  VO_DYN_SMEM(float, sm);
  constexpr int C = kChunk;
  float* G = sm;           // [C]
  float* Bt = G + C;       // [C] beta
  float* rk = Bt + C;      // [C] k row factor (l2 norm)
  float* sc = rk + C;      // [C] row scale of the current right-hand side
  float* At = sc + C;      // [C][C + 1]: A, then T in place
  float* tile = At + C * (C + 1);  // max(C * (kTile + 1), kTile * (max(K, V) + 1))
  const int64_t c = blockIdx.x;
  const int hv = blockIdx.y, kh = hv / (HV / H), tid = threadIdx.x;
  ChunkPos p;
  if (!chunk_pos(cu, offs, N, c, p)) return;
  const int len = p.len;
  const int64_t sk = (int64_t)H * K, sv = (int64_t)HV * V;
  const T* kp = k + p.start * sk + (int64_t)kh * K;
  const T* vp = v + p.start * sv + (int64_t)hv * V;
  chunk_gates(g, beta, p.start, len, HV, hv, G, Bt);
  row_factors(kp, sk, len, K, l2, rk);
  __syncthreads();
  if (tid < C) Gout[(c * HV + hv) * C + tid] = G[tid];

  // A = strict_lower(beta_i exp(G_i - G_j) k^_i . k^_j), k^ the normalised rows; T's unit
  // diagonal stored too (the substitution below never reads it).
  float acc[kAccCC];
  gram_tiles(acc, tile, tile, kp, kp, sk, len, K, rk, rk);
  {
    const int j = tid % C, i0 = tid / C;
#pragma unroll
    for (int r = 0; r < kAccCC; ++r) {
      const int i = i0 + r * (kBlock / C);
      At[i * (C + 1) + j] = i >= len  ? 0.f
                            : j < i   ? Bt[i] * expf(G[i] - G[j]) * acc[r]
                            : j == i  ? 1.f
                                      : 0.f;
    }
  }
  __syncthreads();

  // T = (I + A)^-1, unit lower triangular, by rows: T_ij = -A_ij - sum_{j<m<i} A_im T_mj.
  // blockDim / C lanes share each column j's sum (the row loop is the kernel's serial part);
  // row i is overwritten in place once every thread has read it (two barriers per row).
  {
    const int lpr = blockDim.x / C, j = tid / lpr, part = tid % lpr;
    for (int i = 1; i < len; ++i) {
      float* ai = At + i * (C + 1);
      float t = 0.f;
      if (j < i)
        for (int m = j + 1 + part; m < i; m += lpr) t += ai[m] * At[m * (C + 1) + j];
      t = group_sum(t, lpr);  // every thread takes part
      __syncthreads();
      if (j < i && part == 0) ai[j] = -(ai[j] + t);  // only this thread writes A_ij
      __syncthreads();
    }
  }

  // K~_j = exp(G_last - G_j) k^_j for the state pass (rows past len: 0).
  {
    const float glast = G[C - 1];
    float* kt = Ktout + (c * HV + hv) * (int64_t)C * K;
    for (int e = tid; e < C * K; e += blockDim.x) {
      const int i = e / K, d = e % K;
      kt[e] = i < len ? expf(glast - G[i]) * rk[i] * to_f(kp[i * sk + d]) : 0.f;
    }
  }

  // W = T (beta exp(G) k^), U = T (beta v).
  if (tid < C) sc[tid] = Bt[tid] * expf(G[tid]) * rk[tid];
  __syncthreads();
  tri_apply(At, tile, kp, sk, len, K, sc, Wout + (c * HV + hv) * (int64_t)C * K);
  __syncthreads();
  if (tid < C) sc[tid] = Bt[tid];
  __syncthreads();
  tri_apply(At, tile, vp, sv, len, V, sc, Uout + (c * HV + hv) * (int64_t)C * V);
}

// ------------------------------------------------------------------------------------------
// (b) state pass: per (sequence, value head, V slice), chunk by chunk
// ------------------------------------------------------------------------------------------

// W (then K~) of the current chunk goes through registers: each thread loads its share of
// the next operand from global memory before the current product, so the serial chunk walk
// waits on one memory round trip per chunk at most instead of one per tile.
constexpr int kStage = kChunk * kMaxDim / kBlock;

__global__ void VO_GDN_BOUNDS gdn_chunk_state_kernel(
    const int64_t* __restrict__ offs, int HV, int K, int V, int vs,
    const float* __restrict__ Gbuf, const float* __restrict__ Wbuf,
    const float* __restrict__ Ktbuf, float* __restrict__ Ubuf, float* __restrict__ Hbuf,
    const float* __restrict__ h0, float* __restrict__ final_state) {
  VO_DYN_SMEM(float, sm);
  constexpr int C = kChunk;
  float* h = sm;                   // [vs][K + 1]
  float* vn = h + vs * (K + 1);    // [C][vs + 1]  v'
  float* buf = vn + C * (vs + 1);  // [C][K + 1]   W, then K~
  const int s = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * vs, tid = threadIdx.x;
  const int64_t state_off = ((int64_t)s * HV + hv) * V * K;
  for (int e = tid; e < vs * K; e += blockDim.x) {
    const int r = e / K, d = e % K;
    h[r * (K + 1) + d] = h0 != nullptr ? h0[state_off + (int64_t)(v0 + r) * K + d] : 0.f;
  }
  const int64_t c_begin = offs[s], c_end = offs[s + 1];
  const int CK = C * K;
  float stage[kStage];
  auto fetch = [&](const float* src) {
#pragma unroll
    for (int r = 0; r < kStage; ++r) {
      const int e = tid + r * kBlock;
      if (e < CK) stage[r] = src[e];
    }
  };
  auto spill = [&]() {
#pragma unroll
    for (int r = 0; r < kStage; ++r) {
      const int e = tid + r * kBlock;
      if (e < CK) buf[(e / K) * (K + 1) + e % K] = stage[r];
    }
  };
  if (c_begin < c_end) fetch(Wbuf + (c_begin * HV + hv) * (int64_t)CK);
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t ch = c * HV + hv;
    __syncthreads();  // the previous chunk's h update is done: buf free, h final
    spill();          // W of this chunk
    // The state entering this chunk, for the output kernel.
    float* hout = Hbuf + ch * (int64_t)V * K + (int64_t)v0 * K;
    for (int e = tid; e < vs * K; e += blockDim.x) hout[e] = h[(e / K) * (K + 1) + e % K];
    float* Uc = Ubuf + ch * (int64_t)C * V + v0;
    // This thread's v' elements: column j of the slice, rows i0 + r * (kBlock / vs).
    const int vj = tid % vs, vi0 = tid / vs, vstep = kBlock / vs;
    float acc[kAccCS];
#pragma unroll
    for (int r = 0; r < kAccCS; ++r) {
      const int i = vi0 + r * vstep;
      acc[r] = i < C ? Uc[(int64_t)i * V + vj] : 0.f;
    }
    const float eg = expf(Gbuf[ch * C + C - 1]);
    fetch(Ktbuf + ch * (int64_t)CK);  // in flight during the v' product
    __syncthreads();

    // v' = U - W h^T, [C, vs] in registers; written over U for the output kernel.
    for (int d = 0; d < K; ++d) {
      const float y = h[vj * (K + 1) + d];
#pragma unroll
      for (int r = 0; r < kAccCS; ++r) {
        const int i = vi0 + r * vstep;
        if (i < C) acc[r] -= buf[i * (K + 1) + d] * y;
      }
    }
#pragma unroll
    for (int r = 0; r < kAccCS; ++r) {
      const int i = vi0 + r * vstep;
      if (i < C) {
        vn[i * (vs + 1) + vj] = acc[r];
        Uc[(int64_t)i * V + vj] = acc[r];
      }
    }
    __syncthreads();  // W consumed, v' complete
    spill();          // K~ of this chunk
    if (c + 1 < c_end) fetch(Wbuf + (ch + HV) * (int64_t)CK);  // next chunk's W, in flight
    __syncthreads();

    // h = exp(G_last) h + v'^T K~, [vs, K]; each thread owns its h elements: column
    // d = tid % K of rows j0 + r * (kBlock / K).
    {
      const int d = tid % K, j0 = tid / K, jstep = kBlock / K;
      float hacc[kAccSK];
#pragma unroll
      for (int r = 0; r < kAccSK; ++r) hacc[r] = 0.f;
      for (int m = 0; m < C; ++m) {
        const float y = buf[m * (K + 1) + d];
#pragma unroll
        for (int r = 0; r < kAccSK; ++r) {
          const int j = j0 + r * jstep;
          if (j < vs) hacc[r] += vn[m * (vs + 1) + j] * y;
        }
      }
#pragma unroll
      for (int r = 0; r < kAccSK; ++r) {
        const int j = j0 + r * jstep;
        if (j < vs) h[j * (K + 1) + d] = eg * h[j * (K + 1) + d] + hacc[r];
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < vs * K; e += blockDim.x)
    final_state[state_off + (int64_t)v0 * K + e] = h[(e / K) * (K + 1) + e % K];
}

// ------------------------------------------------------------------------------------------
// (c) output per (chunk slot, value head)
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void VO_GDN_BOUNDS gdn_chunk_output_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const int64_t* __restrict__ cu,
    const int64_t* __restrict__ offs, int N, int H, int HV, int K, int V, float scale, bool l2,
    const float* __restrict__ Gbuf, const float* __restrict__ Vn,
    const float* __restrict__ Hbuf, T* __restrict__ out) {
  VO_DYN_SMEM(float, sm);
  constexpr int C = kChunk;
  float* G = sm;             // [C]
  float* rq = G + C;         // [C] q row factor * scale (* exp(G) for the state term)
  float* rk = rq + C;        // [C]
  float* S = rk + C;         // [C][C + 1]
  float* tile = S + C * (C + 1);
  const int64_t c = blockIdx.x;
  const int hv = blockIdx.y, kh = hv / (HV / H), tid = threadIdx.x;
  ChunkPos p;
  if (!chunk_pos(cu, offs, N, c, p)) return;
  const int len = p.len;
  const int64_t sk = (int64_t)H * K;
  const T* qp = q + p.start * sk + (int64_t)kh * K;
  const T* kp = k + p.start * sk + (int64_t)kh * K;
  const int64_t ch = c * HV + hv;
  if (tid < C) G[tid] = Gbuf[ch * C + tid];
  row_factors(qp, sk, len, K, l2, rq);
  row_factors(kp, sk, len, K, l2, rk);
  __syncthreads();
  if (tid < C) rq[tid] *= scale;

  // S = lower(Gamma) * (q^ k^T) scale, Gamma_ij = exp(G_i - G_j).
  float* qt = tile;                     // [C][kTile + 1]
  float* ktl = tile + C * (kTile + 1);  // [C][kTile + 1]
  {
    float acc[kAccCC];
    gram_tiles(acc, qt, ktl, qp, kp, sk, len, K, rq, rk);
    const int j = tid % C, i0 = tid / C;
#pragma unroll
    for (int r = 0; r < kAccCC; ++r) {
      const int i = i0 + r * (kBlock / C);
      S[i * (C + 1) + j] = (j <= i && i < len) ? expf(G[i] - G[j]) * acc[r] : 0.f;
    }
  }
  __syncthreads();
  if (tid < C) rq[tid] *= expf(G[tid]);  // the state term's exp(G_i)

  // o = (exp(G) q^ scale) h^T over K tiles of q and h: this thread's outputs are column
  // j = tid % V of rows i0 + r * (kBlock / V) ...
  const int j = tid % V, i0 = tid / V, nr = C * V / kBlock;
  float o[kAccCD];
#pragma unroll
  for (int r = 0; r < kAccCD; ++r) o[r] = 0.f;
  float* ht = tile + C * (kTile + 1);  // [V][kTile + 1]
  const float* hc = Hbuf + ch * (int64_t)V * K;
  for (int k0 = 0; k0 < K; k0 += kTile) {
    __syncthreads();
    load_tile(qt, qp, sk, 0, C, k0, kTile, len, rq);
    for (int e = tid; e < V * kTile; e += blockDim.x) {
      const int r = e / kTile, d = e % kTile;
      ht[r * (kTile + 1) + d] = hc[(int64_t)r * K + k0 + d];
    }
    __syncthreads();
    for (int d = 0; d < kTile; ++d) {
      const float y = ht[j * (kTile + 1) + d];
#pragma unroll
      for (int r = 0; r < kAccCD; ++r)
        if (r < nr) o[r] += qt[(i0 + r * (kBlock / V)) * (kTile + 1) + d] * y;
    }
  }
  // ... plus S v' over row tiles of v' (S is 0 above the diagonal and past len).
  rows_times_tiles(o, S, C + 1, tile, Vn + ch * (int64_t)C * V, (int64_t)V, C, V,
                   static_cast<const float*>(nullptr));
  const int64_t so = (int64_t)HV * V;
  T* op = out + p.start * so + (int64_t)hv * V;
#pragma unroll
  for (int r = 0; r < kAccCD; ++r) {
    const int i = i0 + r * (kBlock / V);
    if (r < nr && i < len) op[i * so + j] = static_cast<T>(o[r]);
  }
}

// ------------------------------------------------------------------------------------------
// Chunk offsets: cu_seqlens (int32 or int64) -> int64 cu and cumulative chunk counts, one tiny
// launch (no host sync, no chain of small torch ops). One thread walks the N sequences.
// ------------------------------------------------------------------------------------------

template <typename I>
__global__ void gdn_chunk_offsets_kernel(const I* __restrict__ cu_in, int N,
                                         int64_t* __restrict__ cu, int64_t* __restrict__ offs) {
  if (threadIdx.x != 0) return;
  int64_t acc = 0;
  cu[0] = static_cast<int64_t>(cu_in[0]);
  offs[0] = 0;
  for (int s = 0; s < N; ++s) {
    const int64_t b = static_cast<int64_t>(cu_in[s + 1]);
    acc += (b - cu[s] + kChunk - 1) / kChunk;
    cu[s + 1] = b;
    offs[s + 1] = acc;
  }
}

// ------------------------------------------------------------------------------------------
// Host wrapper
// ------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> gdn_chunk_prefill(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& cu_seqlens,
    const c10::optional<at::Tensor>& initial_state, double scale, bool l2norm,
    int64_t v_split) {
  TORCH_CHECK(VO_ON_DEVICE(q) && VO_ON_DEVICE(k) && VO_ON_DEVICE(v),
              "gdn_chunk_prefill: CUDA tensors expected");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "gdn_chunk_prefill: q, k [T, H, K], v [T, HV, V]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "gdn_chunk_prefill: q, k, v must share a dtype");
  const int64_t T = q.size(0);
  const int H = q.size(1), K = q.size(2), HV = v.size(1), V = v.size(2);
  TORCH_CHECK(HV % H == 0, "gdn_chunk_prefill: HV must be a multiple of H");
  // A thread keeps one column of every [C, K] / [C, V] product: K and V divide the block.
  auto dim_ok = [](int d) { return d == 32 || d == 64 || d == 128; };
  TORCH_CHECK(dim_ok(K) && dim_ok(V), "gdn_chunk_prefill: K, V must be 32, 64 or 128");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  g.numel() == T * HV && beta.numel() == T * HV,
              "gdn_chunk_prefill: float32 g, beta [T, HV]");
  TORCH_CHECK(VO_ON_DEVICE(cu_seqlens) && cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 2,
              "gdn_chunk_prefill: cu_seqlens [N + 1] on the device");
  const int N = cu_seqlens.numel() - 1;
  if (initial_state.has_value())
    TORCH_CHECK(initial_state->scalar_type() == at::kFloat && initial_state->dim() == 4 &&
                    initial_state->size(0) == N && initial_state->size(1) == HV &&
                    initial_state->size(2) == V && initial_state->size(3) == K,
                "gdn_chunk_prefill: float32 initial_state [N, HV, V, K]");
  int vs = static_cast<int>(v_split);
  if (vs <= 0) {
    // Slices of 8 rows give N * HV * V / 8 blocks (128 for one sequence at TP4); wider slices,
    // which re-read W and K~ less often, once there are sequences enough to fill the device.
    vs = (int64_t)N * HV * V / 16 >= 256 ? 16 : 8;
  }
  TORCH_CHECK(vs >= 1 && vs <= kMaxVSplit && (vs & (vs - 1)) == 0 && V % vs == 0,
              "gdn_chunk_prefill: v_split must be a power of two <= 16 dividing V");
  VO_DEVICE_GUARD(q);
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto gc = g.contiguous(), bc = beta.contiguous();
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong,
              "gdn_chunk_prefill: int32 / int64 cu_seqlens");
  auto cu_in = cu_seqlens.contiguous();
  // [cu as int64 | cumulative chunk counts], both [N + 1], from one tiny kernel.
  auto meta = at::empty({2 * (N + 1)}, q.options().dtype(at::kLong));
  const int64_t* cup = meta.data_ptr<int64_t>();
  const int64_t* offp = cup + (N + 1);
  if (cu_in.scalar_type() == at::kInt) {
    VO_LAUNCH(gdn_chunk_offsets_kernel<int32_t>, 1, 64, 0, cu_in.data_ptr<int32_t>(), N,
        meta.data_ptr<int64_t>(), meta.data_ptr<int64_t>() + (N + 1));
  } else {
    VO_LAUNCH(gdn_chunk_offsets_kernel<int64_t>, 1, 64, 0, cu_in.data_ptr<int64_t>(), N,
        meta.data_ptr<int64_t>(), meta.data_ptr<int64_t>() + (N + 1));
  }
  c10::optional<at::Tensor> h0;
  if (initial_state.has_value()) h0 = initial_state->contiguous();

  auto out = at::empty({T, HV, V}, q.options());
  auto fin = at::empty({N, HV, V, K}, q.options().dtype(at::kFloat));
  // Chunk slots: sum of ceil(len / C) <= T / C + N, from shapes alone.
  const int64_t slots = T / kChunk + N;
  auto f32 = q.options().dtype(at::kFloat);
  auto Gb = at::empty({slots, HV, kChunk}, f32);
  auto Wb = at::empty({slots, HV, kChunk, K}, f32);
  auto Ub = at::empty({slots, HV, kChunk, V}, f32);  // U, then v'
  auto Hb = at::empty({slots, HV, V, K}, f32);
  auto Kt = at::empty({slots, HV, kChunk, K}, f32);  // K~ rows
  const int D = std::max(K, V);
  const size_t smem_a =
      (4 * kChunk + kChunk * (kChunk + 1) + std::max(kChunk * (kTile + 1), kTile * (D + 1))) *
      sizeof(float);
  const size_t smem_b = (vs * (K + 1) + kChunk * (vs + 1) + kChunk * (K + 1)) * sizeof(float);
  const size_t smem_c =
      (3 * kChunk + kChunk * (kChunk + 1) +
       std::max({2 * kChunk * (kTile + 1), (kChunk + V) * (kTile + 1), kTile * (V + 1)})) *
      sizeof(float);
  const float* h0p = h0.has_value() ? h0->data_ptr<float>() : nullptr;
  VO_DISPATCH_FLOATS(q.scalar_type(), "gdn_chunk_prefill", [&] {
    using T_ = scalar_t;
    if (slots > 0 && T > 0) {
      VO_LAUNCH(gdn_chunk_prep_kernel<T_>, dim3(slots, HV), kBlock, smem_a,
          kc.data_ptr<T_>(), vc.data_ptr<T_>(), gc.data_ptr<float>(), bc.data_ptr<float>(),
          cup, offp, N, H, HV, K, V, l2norm, Gb.data_ptr<float>(), Wb.data_ptr<float>(),
          Ub.data_ptr<float>(), Kt.data_ptr<float>());
    }
    VO_LAUNCH(gdn_chunk_state_kernel, dim3(N, HV, V / vs), kBlock, smem_b,
        offp, HV, K, V, vs, Gb.data_ptr<float>(), Wb.data_ptr<float>(), Kt.data_ptr<float>(),
        Ub.data_ptr<float>(), Hb.data_ptr<float>(), h0p, fin.data_ptr<float>());
    if (slots > 0 && T > 0) {
      VO_LAUNCH(gdn_chunk_output_kernel<T_>, dim3(slots, HV), kBlock, smem_c,
          qc.data_ptr<T_>(), kc.data_ptr<T_>(), cup, offp, N, H, HV, K, V,
          static_cast<float>(scale), l2norm, Gb.data_ptr<float>(), Ub.data_ptr<float>(),
          Hb.data_ptr<float>(), out.data_ptr<T_>());
    }
  });
  return {out, fin};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vo_kernels, m) {
  m.def("gdn_chunk_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,"
        " Tensor cu_seqlens, Tensor? initial_state, float scale, bool l2norm, int v_split)"
        " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vo_kernels, VO_DISPATCH_KEY, m) {
  m.impl("gdn_chunk_prefill", &gdn_chunk_prefill);
}
