// Fused GDN chunk prefill kernels (vllm_overrides.native.kernels.chunk_gated_delta_rule).
//
// The chunked (WY) gated delta rule over packed varlen sequences, chunk size C = 64, in three
// launches after a one-thread one that turns cu_seqlens into per-sequence chunk offsets on the
// device (no host sync):
//
//   (a) prep (gdn_chunk_prep[_mma]_kernel), one block per (chunk slot, value head):
//         G = in-chunk cumsum(g);  A = strict_lower(beta_i exp(G_i - G_j) k_i.k_j);
//         T = (I + A)^-1 (float32 in shared memory: forward substitution by rows in the float32
//         kernel; blocked over 16x16 blocks in the _mma one, see tri_inverse_blocked);
//         W = T (beta exp(G) k),  U = T (beta v),  K~_j = exp(G_last - G_j) k_j
//   (b) state pass (gdn_chunk_state[_mma]_kernel), one block per (sequence, value head, slice
//       of V rows), walking that sequence's chunks in order:
//         store h (the state entering the chunk);  v' = U - W h^T (float32 path: over U);
//         h = exp(G_last) h + v'^T K~;  the last h -> the final state
//   (c) output (gdn_chunk_output[_mma]_kernel), one block per (chunk slot, value head):
//         o = exp(G) (q h^T) scale + (lower(Gamma) * q k^T scale) v'
//
// The math is gdn.chunk_gated_delta_rule's (see its docstring); the state is vLLM's [V, K]
// layout. Two implementations of the three passes, chosen by the input dtype:
//
// * fp16 / bf16 (the serving case): every product on tensor cores through nvcuda::wmma
//   16x16x16 tiles (the portable form: no PTX, no CUTLASS), operands in the input's own 16-bit
//   type (__half / __nv_bfloat16; bf16 needs sm_80, below that bf16 takes the float32 path),
//   float accumulation. Raw q, k, v enter the products unrounded (exact in their type) and the
//   row factors (l2 norm, beta, decays, scale) are applied in float32 on the other side: to
//   the Gram matrices' entries, to T's columns, to the output tile's rows. What is rounded to
//   16 bits, as FLA does: T (but split T_hi + T_lo, two products, so ~16 significant bits
//   survive), W, K~, h (the B operand of W h^T; the state itself stays in float32
//   accumulator fragments for the whole walk), v' (split v'_hi + v'_lo in the state update,
//   single in the output) and S = lower(Gamma) * q k^T. Scratch: G, U, final state float32;
//   W, K~, v', h_c in the input dtype. Shared memory (K = V = 128, kBlock 256), each past
//   the 48 KB default (opt-in): prep 48.25 KB, state 56 KB (W and K~ of a chunk both
//   resident), output 94 KB (q, k, h and v' all resident; two blocks per SM on an H200).
//   The state pass uses 16-row V slices (one wmma tile row; v_split is not used), warp w
//   keeping h tiles w, w + nwarps, ...; the next chunk's W, K~ (registers) and U (fragments)
//   load while the current chunk computes. Each warp stages accumulator tiles through its own
//   16x16 float scratch tile for per-row scaling and dtype conversion (the fragment's
//   element -> (row, col) map is unspecified; the output pass scales instead by an accumulator
//   fragment loaded from a tile of its row factors). Tiles are handed to warps in loops over
//   kBlock / WS warps (the three tensor-core kernels take the warp width WS as a template
//   constant that the host reads from the device), so any warp width works (wmma is
//   warp-collective).
// * float32: float32 FMA loops over shared-memory tiles (16-bit operands would miss float32
//   accuracy), in which a thread keeps one output column for several rows in registers, so
//   each operand element it loads feeds several FMAs (the other operand is a broadcast);
//   every tile keeps a +1 float row pad so column walks hit distinct banks. Shared memory
//   stays below 48 KB for K, V <= 128; all scratch float32.
//
// Chunk slots are an upper bound (T / C + N) known from shapes, so the grid needs no host
// sync; slots past the real chunk count return at once. Padded rows of a sequence's last
// chunk carry g = 0, beta = 0, k = 0: they write nothing and decay nothing.
//
// Portability as in common.cuh: no warp size assumed (per-row reductions use group_sum over
// blockDim / C lanes, a power of two <= 16; wmma tiles loop over the block's warps), block
// size kBlock (a multiple of 64), float32 accumulation, no float64 on the device. The CPU
// test build runs these kernels with cpu_emulation.h's wmma model.
#include "common.cuh"

// The kernels are written for exactly kBlock threads (per-thread accumulator counts are
// compile-time); telling the compiler lets it budget registers for that block size.
#ifdef VO_CPU_EMULATION
#define VO_GDN_BOUNDS
#define VO_GDN_BOUNDS2
#else
#define VO_GDN_BOUNDS __launch_bounds__(kBlock)
// The tensor-core prep / output kernels: two blocks per SM at least (<= 128 registers at 256
// threads); left alone, ptxas gave the fp16 prep 64 registers and a spill.
#define VO_GDN_BOUNDS2 __launch_bounds__(kBlock, 2)
#endif

namespace {

constexpr int kChunk = 64;  // C: tokens per chunk (vLLM / FLA use 64 too)
// K-dimension (or row) tile of the float32 path's shared-memory products: 16 keeps its prep and
// output blocks at 25 / 30 KB for K = V = 128, under the card's 32 KB (32 needed 33 / 42 KB).
constexpr int kTile = 16;
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
  const int lo = owner_of(offs, N, c);
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
// Float32 path (float32 inputs). (a) intra-chunk: G, T = (I + A)^-1, W, U
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
// Float32 path. (b) state pass: per (sequence, value head, V slice), chunk by chunk
// ------------------------------------------------------------------------------------------

// W (then K~) of the current chunk goes through registers: each thread loads its share of
// the next operand from global memory before the current product, so the serial chunk walk
// waits on one memory round trip per operand at most instead of one per tile.
// `nh` (1 or 2): the operands pass through shared memory in nh row blocks of C / nh rows, so a
// device granting a block less than the whole [C, K + 1] float buffer (33 KB at K = 128:
// the card's 32 KB) still runs the kernel -- 2 nh barriers a chunk instead of 2.
constexpr int kStage = kChunk * kMaxDim / kBlock;

__global__ void VO_GDN_BOUNDS gdn_chunk_state_kernel(
    const int64_t* __restrict__ offs, int HV, int K, int V, int vs, int nh,
    const float* __restrict__ Gbuf, const float* __restrict__ Wbuf,
    const float* __restrict__ Ktbuf, float* __restrict__ Ubuf, float* __restrict__ Hbuf,
    const float* __restrict__ h0, float* __restrict__ final_state) {
  VO_DYN_SMEM(float, sm);
  constexpr int C = kChunk;
  const int R = C / nh;            // rows of an operand block
  float* h = sm;                   // [vs][K + 1]
  float* vn = h + vs * (K + 1);    // [C][vs + 1]  v'
  float* buf = vn + C * (vs + 1);  // [R][K + 1]   a row block of W, then of K~
  const int s = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * vs, tid = threadIdx.x;
  const int64_t state_off = ((int64_t)s * HV + hv) * V * K;
  for (int e = tid; e < vs * K; e += blockDim.x) {
    const int r = e / K, d = e % K;
    h[r * (K + 1) + d] = h0 != nullptr ? h0[state_off + (int64_t)(v0 + r) * K + d] : 0.f;
  }
  const int64_t c_begin = offs[s], c_end = offs[s + 1];
  const int CK = C * K, RK = R * K;
  // Operand `step` of a chunk: W row blocks 0 .. nh - 1, then K~ row blocks 0 .. nh - 1.
  auto operand = [&](int64_t ch, int step) {
    return (step < nh ? Wbuf : Ktbuf) + ch * (int64_t)CK + (int64_t)(step % nh) * RK;
  };
  float stage[kStage];
  auto fetch = [&](const float* src) {
#pragma unroll
    for (int r = 0; r < kStage; ++r) {
      const int e = tid + r * kBlock;
      if (e < RK) stage[r] = src[e];
    }
  };
  auto spill = [&]() {
#pragma unroll
    for (int r = 0; r < kStage; ++r) {
      const int e = tid + r * kBlock;
      if (e < RK) buf[(e / K) * (K + 1) + e % K] = stage[r];
    }
  };
  if (c_begin < c_end) fetch(operand(c_begin * HV + hv, 0));
  // This thread's v' elements: column vj of the slice, rows vi0 + r * vstep; its h elements:
  // column d = tid % K of rows j0 + r * jstep.
  const int vj = tid % vs, vi0 = tid / vs, vstep = kBlock / vs;
  const int hd = tid % K, j0 = tid / K, jstep = kBlock / K;
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t ch = c * HV + hv;
    __syncthreads();  // the previous chunk's h update is done: buf free, h final
    // The state entering this chunk, for the output kernel.
    float* hout = Hbuf + ch * (int64_t)V * K + (int64_t)v0 * K;
    for (int e = tid; e < vs * K; e += blockDim.x) hout[e] = h[(e / K) * (K + 1) + e % K];
    float* Uc = Ubuf + ch * (int64_t)C * V + v0;
    float acc[kAccCS];
#pragma unroll
    for (int r = 0; r < kAccCS; ++r) {
      const int i = vi0 + r * vstep;
      acc[r] = i < C ? Uc[(int64_t)i * V + vj] : 0.f;
    }
    float hacc[kAccSK];
#pragma unroll
    for (int r = 0; r < kAccSK; ++r) hacc[r] = 0.f;
    const float eg = expf(Gbuf[ch * C + C - 1]);
    for (int step = 0; step < 2 * nh; ++step) {
      if (step > 0) __syncthreads();  // the previous operand block is consumed
      spill();
      // The next operand (this chunk's next block, or the next chunk's first), in flight
      // during this product.
      if (step + 1 < 2 * nh) fetch(operand(ch, step + 1));
      else if (c + 1 < c_end) fetch(operand(ch + HV, 0));
      __syncthreads();
      const int rb = (step % nh) * R;  // first chunk row of the block in buf
      if (step < nh) {
        // v' = U - W h^T over this block's rows, [C, vs] in registers.
        for (int d = 0; d < K; ++d) {
          const float y = h[vj * (K + 1) + d];
#pragma unroll
          for (int r = 0; r < kAccCS; ++r) {
            const int i = vi0 + r * vstep;
            if (i >= rb && i < rb + R) acc[r] -= buf[(i - rb) * (K + 1) + d] * y;
          }
        }
        if (step == nh - 1) {  // v' complete: to shared memory and over U (output kernel)
#pragma unroll
          for (int r = 0; r < kAccCS; ++r) {
            const int i = vi0 + r * vstep;
            if (i < C) {
              vn[i * (vs + 1) + vj] = acc[r];
              Uc[(int64_t)i * V + vj] = acc[r];
            }
          }
        }
      } else {
        // h += v'^T K~ over this block's rows (vn complete: the barrier above).
        for (int m = 0; m < R; ++m) {
          const float y = buf[m * (K + 1) + hd];
#pragma unroll
          for (int r = 0; r < kAccSK; ++r) {
            const int j = j0 + r * jstep;
            if (j < vs) hacc[r] += vn[(rb + m) * (vs + 1) + j] * y;
          }
        }
      }
    }
    // h = exp(G_last) h + v'^T K~ (each thread its own elements; every read of h in this
    // chunk was before the last barrier).
#pragma unroll
    for (int r = 0; r < kAccSK; ++r) {
      const int j = j0 + r * jstep;
      if (j < vs) h[j * (K + 1) + hd] = eg * h[j * (K + 1) + hd] + hacc[r];
    }
  }
  __syncthreads();
  for (int e = tid; e < vs * K; e += blockDim.x)
    final_state[state_off + (int64_t)v0 * K + e] = h[(e / K) * (K + 1) + e % K];
}

// ------------------------------------------------------------------------------------------
// Float32 path. (c) output per (chunk slot, value head)
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
// Tensor-core path (fp16 / bf16 inputs): the same three passes with every product on
// nvcuda::wmma 16x16x16 tiles, 16-bit operands of the input's type, float accumulation.
// ------------------------------------------------------------------------------------------


template <typename M>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, M, wmma::row_major>;
template <typename M>
using FragAt = wmma::fragment<wmma::matrix_a, 16, 16, 16, M, wmma::col_major>;
template <typename M>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, M, wmma::row_major>;
template <typename M>
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, M, wmma::col_major>;

// Row pitch of 16-bit tiles: +8 elements keeps wmma's ldm rule (a multiple of 16 bytes) and
// shifts consecutive rows by 16 bytes, so a tile's 16 rows spread over the banks.
__host__ __device__ constexpr int pitch16(int cols) { return cols + 8; }
__host__ __device__ constexpr int round128(int bytes) { return (bytes + 127) / 128 * 128; }
// One 16x16 float staging tile per warp (accumulator -> per-row scaling / dtype conversion);
// warps are at least 32 lanes wide, so kBlock / 32 tiles cover any warp size.
// A warp's scratch tile: kScrWarp floats (frag_out8; the tile's other users keep rows 16
// apart inside it).
constexpr int kScratchBytes = kBlock / 32 * kScrWarp * 4;
// Float pitch of the prep kernel's A / T matrix (C + 8 floats: the region then holds exactly
// the two 16-bit [C][C + 8] halves T_hi, T_lo that replace it).
constexpr int kLdA = kChunk + 8;

// Shared-memory layouts (bytes), shared by the kernels and the host wrapper.
struct PrepLayout {  // vectors | X: k then v rows (16-bit) | A / T float, then T_hi, T_lo | scratch
  int x, a, scratch, total;
  __host__ __device__ PrepLayout(int K, int V) {
    const int D = K > V ? K : V;
    x = round128(5 * kChunk * 4);
    a = x + round128(kChunk * pitch16(D) * 2);
    const int abytes = kChunk * kLdA * 4, tbytes = 2 * kChunk * pitch16(kChunk) * 2;
    scratch = a + round128(abytes > tbytes ? abytes : tbytes);
    total = scratch + kScratchBytes;
  }
};
struct StateLayout {  // W | K~ | h | v' hi, lo (all 16-bit) | scratch
  int kt, h, vn, vlo, scratch, total;
  __host__ __device__ StateLayout(int K, int vs) {
    kt = round128(kChunk * pitch16(K) * 2);
    h = kt + round128(kChunk * pitch16(K) * 2);
    vn = h + round128(vs * pitch16(K) * 2);
    vlo = vn + round128(kChunk * pitch16(vs) * 2);
    scratch = vlo + round128(kChunk * pitch16(vs) * 2);
    total = scratch + kScratchBytes;
  }
};
// vectors, row-factor tiles | q rows | k rows, then S + scratch | h [V, K] | v' [C, V] (16-bit)
struct OutLayout {
  int rt, q, k, s, scratch, h, vn, total;
  __host__ __device__ OutLayout(int K, int V) {
    rt = round128(3 * kChunk * 4);
    q = rt + kChunk * 16 * 4;
    k = q + round128(kChunk * pitch16(K) * 2);
    s = k;
    scratch = s + round128(kChunk * pitch16(kChunk) * 2);
    const int kend = k + round128(kChunk * pitch16(K) * 2);
    h = (scratch + kScratchBytes > kend ? scratch + kScratchBytes : kend);
    vn = h + round128(V * pitch16(K) * 2);
    total = vn + round128(kChunk * pitch16(V) * 2);
  }
};

// 16-byte vectors of a [rows, D] 16-bit operand (row stride `stride` elements), in registers:
// thread tid holds row e / (D / 8), columns (e % (D / 8)) * 8 .. + 7, for e = tid + r * kBlock
// (zero at or past row `len`). `vec`: x allows 16-byte loads; else eight 16-bit loads build
// the same vector (T, at::Half / at::BFloat16, has the bits of its wmma type). store_vecs puts
// them in shared memory (row pitch ld). Loading everything first keeps the loads in flight
// together.
template <int N, typename T>
__device__ __forceinline__ void load_vecs(uint4 (&st)[N], const T* __restrict__ x,
                                          int64_t stride, int rows, int len, int D, bool vec) {
  static_assert(sizeof(T) == 2, "16-bit operands");
  const int per = D / 8;
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const int e = threadIdx.x + r * kBlock, row = e / per;
    st[r] = uint4{0u, 0u, 0u, 0u};
    if (e < rows * per && row < len) {
      const T* p = x + row * stride + (e % per) * 8;
      if (vec) {
        st[r] = *reinterpret_cast<const uint4*>(p);
      } else {
        const uint16_t* p16 = reinterpret_cast<const uint16_t*>(p);
        uint16_t* y = reinterpret_cast<uint16_t*>(&st[r]);
#pragma unroll
        for (int u = 0; u < 8; ++u) y[u] = p16[u];
      }
    }
  }
}

template <int N, typename M>
__device__ __forceinline__ void store_vecs(M* __restrict__ dst, int ld, const uint4 (&st)[N],
                                           int rows, int D) {
  const int per = D / 8;
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const int e = threadIdx.x + r * kBlock;
    if (e < rows * per) *reinterpret_cast<uint4*>(dst + (e / per) * ld + (e % per) * 8) = st[r];
  }
}

constexpr int kRowVecs = kChunk * kMaxDim / 8 / kBlock;  // uint4 per thread: [C, D] operand
constexpr int kStateVecs = kMaxDim * kMaxDim / 8 / kBlock;  // uint4 per thread: [V, K] h

// Row factors of a [C, D] operand staged by load_vecs: rsqrt(|x|^2 + 1e-6) (l2) or 1, 0 at or
// past row len. The D / 8 consecutive lanes holding a row (a power of two <= 16) sum their
// squares; every thread takes part.
template <typename T>
__device__ __forceinline__ void vec_row_factors(const uint4 (&st)[kRowVecs], int D, int len,
                                                bool l2, float* __restrict__ out) {
  using M = typename Mma<T>::type;
  const int per = D / 8;
#pragma unroll
  for (int r = 0; r < kRowVecs; ++r) {
    const int e = threadIdx.x + r * kBlock, row = e / per;
    float ss = 0.f;
    if (l2) {
      const M* y = reinterpret_cast<const M*>(&st[r]);
#pragma unroll
      for (int u = 0; u < 8; ++u) ss += Mma<T>::to(y[u]) * Mma<T>::to(y[u]);
      ss = group_sum(ss, per);  // uniform branch
    }
    if (e < kChunk * per && e % per == 0)
      out[row] = row < len ? (l2 ? rsqrtf(ss + 1e-6f) : 1.f) : 0.f;
  }
}

// T = (I + A)^-1 of the prep_mma kernel, in place: A [C, C] float32 in shared memory (row
// pitch lda) strictly lower with its diagonal stored (1, or 0 on rows past len, whose A rows
// are all 0: their T rows come out 0, as the row-by-row substitution left them). Blocked, as
// FLA's solve_tril, over the 16x16 blocks (i, j) of I + A = D + N (D its diagonal blocks):
//   1. T_jj = D_j^-1: one thread per column of each diagonal block, forward substitution in
//      registers (column sweep: t_r -= A_rm t_m, so the dependent chain is ~16 FMAs deep);
//   2. B_im = T_ii A_im for the 6 blocks below the diagonal (i > m), stored in the unused
//      upper block (m, i) of the same matrix; A's off-diagonal blocks are then dead;
//   3. level by level (i - j = 1, 2, 3): T_ij = -sum_{m=j}^{i-1} B_im T_mj, over A_ij.
// Every product float32 FMAs (T is split T_hi + T_lo later because its precision matters);
// six barriers in all (the row-by-row substitution took two per row plus a group_sum). The
// caller has A complete behind a barrier; on return T's lower triangle (its diagonal
// included) is complete behind a barrier, and the blocks above the diagonal hold B (the
// caller reads the lower triangle only). No shared memory beyond the matrix itself.
constexpr int kSub = 16;                 // diagonal block size
constexpr int kNSub = kChunk / kSub;     // 4 blocks per side
constexpr int kNOff = kNSub * (kNSub - 1) / 2;  // 6 blocks below the diagonal
static_assert(kNSub == 4 && kBlock >= 32 * kNSub, "4 diagonal blocks, a thread per column");

__device__ __forceinline__ void tri_inverse_blocked(float* At, int lda) {
  constexpr int S = kSub, SS = kSub * kSub;
  const int tid = threadIdx.x;
  // 1. Diagonal blocks: thread 32 b + c (c < 16) takes column c of block b (so the four
  // blocks' columns run in different 32-lane warps; any warp width works). The block's A
  // entries are broadcasts (same address for the block's threads).
  {
    const int b = tid / 32, c = tid % 32;
    const bool act = b < kNSub && c < S;
    float* d = At + (act ? b : 0) * S * (lda + 1);  // block b's top-left corner
    float t[S];
    if (act) {
#pragma unroll
      for (int r = 0; r < S; ++r) t[r] = r == c ? d[r * (lda + 1)] : 0.f;  // 1 (0 past len)
      // t_r = -sum_{c<=m<r} A_rm t_m (the terms with m < c add exact zeros).
#pragma unroll
      for (int m = 0; m < S - 1; ++m)
#pragma unroll
        for (int r = m + 1; r < S; ++r) t[r] = fmaf(-d[r * lda + m], t[m], t[r]);
    }
    __syncthreads();  // every D_j read
    if (act)
#pragma unroll
      for (int r = 0; r < S; ++r) d[r * lda + c] = t[r];
  }
  __syncthreads();
  // 2. B_im = T_ii A_im (k = i (i - 1) / 2 + m enumerates the blocks i > m), at block (m, i).
#pragma unroll
  for (int u = 0; u < (kNOff * SS + kBlock - 1) / kBlock; ++u) {
    const int e = tid + u * kBlock;
    if (e < kNOff * SS) {
      const int k = e / SS, r = e % SS / S, s = e % S;
      const int i = k < 1 ? 1 : k < 3 ? 2 : 3, m = k - i * (i - 1) / 2;
      const float* ti = At + i * S * (lda + 1) + r * lda;  // row r of T_ii
      const float* am = At + i * S * lda + m * S + s;      // column s of A_im
      float acc = 0.f;
#pragma unroll
      for (int q = 0; q < S; ++q) acc = fmaf(ti[q], am[q * lda], acc);
      At[(m * S + r) * lda + i * S + s] = acc;
    }
  }
  __syncthreads();
  // 3. Off-diagonal T by levels; level lv reads blocks of levels < lv and writes its own.
#pragma unroll
  for (int lv = 1; lv < kNSub; ++lv) {
    const int n = (kNSub - lv) * SS;
#pragma unroll
    for (int u = 0; u < (n + kBlock - 1) / kBlock; ++u) {
      const int e = tid + u * kBlock;
      if (e < n) {
        const int j = e / SS, i = j + lv, r = e % SS / S, c = e % S;
        float acc = 0.f;
#pragma unroll
        for (int mm = 0; mm < lv; ++mm) {
          const int m = j + mm;
          const float* bim = At + (m * S + r) * lda + i * S;  // row r of B_im
          const float* tmj = At + m * S * lda + j * S + c;
#pragma unroll
          for (int q = 0; q < S; ++q) acc = fmaf(bim[q], tmj[q * lda], acc);
        }
        At[(i * S + r) * lda + j * S + c] = -acc;
      }
    }
    __syncthreads();
  }
}

// (a) intra-chunk, one block per (chunk slot, value head). With k^ = rk k (rk the l2 factor):
//   A = strict_lower(beta_i Gamma_ij rk_i rk_j (k k^T)_ij)  (raw k operands, factors in float),
//   T = (I + A)^-1 (float32, blocked: tri_inverse_blocked, six barriers),
//   W = T diag(beta exp(G) rk) k,  U = T diag(beta) v       (raw k / v operands; the column
//   scaled T split as T_hi + T_lo, both 16-bit, so T keeps ~16 significant bits),
//   K~ = exp(G_last - G) rk k.
// W, K~ are stored 16-bit (the state pass's operands), U float32 (its accumulator init).
// KD, VD: the model's head dims as template constants (kDimsFixed: Qwen3.5/3.6 use 128 for
// both), or 0 for the generic instantiation that takes them at run time. Known dims turn the
// staging loops' row / column splits into shifts and let the tile loops unroll (the state
// pass's instruction count halved, below).
constexpr int kDimsFixed = 128;
template <typename T, int KD, int VD, int WS>
__global__ void VO_GDN_BOUNDS2 gdn_chunk_prep_mma_kernel(
    const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ g,
    const float* __restrict__ beta, const int64_t* __restrict__ cu,
    const int64_t* __restrict__ offs, int N, int H, int HV, int K_, int V_, bool l2,
    float* __restrict__ Gout, typename Mma<T>::type* __restrict__ Wout,
    float* __restrict__ Uout, typename Mma<T>::type* __restrict__ Ktout) {
  if constexpr (!mma_arch_ok<T>()) {
    __trap();
  } else {
    using M = typename Mma<T>::type;
    constexpr int C = kChunk;
    const int K = KD ? KD : K_, V = VD ? VD : V_;  // see kDimsFixed
    VO_MMA_SMEM(smb);
    const PrepLayout L(K, V);
    float* G = reinterpret_cast<float*>(smb);
    float* Bt = G + C;
    float* rk = Bt + C;
    float* cs = rk + C;  // column scale of T for the current product
    float* fk = cs + C;  // K~'s row factor exp(G_last - G_i) rk_i
    M* X = reinterpret_cast<M*>(smb + L.x);
    float* At = reinterpret_cast<float*>(smb + L.a);
    M* Thi = reinterpret_cast<M*>(smb + L.a);
    M* Tlo = Thi + C * pitch16(C);
    constexpr int nwarps = kBlock / WS;  // WS: as the state pass's (below)
    const int warp = threadIdx.x / WS;
    float* scr = reinterpret_cast<float*>(smb + L.scratch) + warp * kScrWarp;
    const int lda = kLdA, ldx = pitch16(K > V ? K : V), ldt = pitch16(C);
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, kh = hv / (HV / H), tid = threadIdx.x;
    ChunkPos p;
    if (!chunk_pos(cu, offs, N, c, p)) return;
    const int len = p.len;
    const int64_t sk = (int64_t)H * K, sv = (int64_t)HV * V, ch = c * HV + hv;
    const T* kp = k + p.start * sk + (int64_t)kh * K;
    const T* vp = v + p.start * sv + (int64_t)hv * V;
    // k, v are the caller's tensors (a view need not be 16-byte aligned). Rows come in as
    // 16-byte vectors, all loads of a row set in flight together.
    const bool veck = (reinterpret_cast<uintptr_t>(k) & 15) == 0;
    const bool vecv = (reinterpret_cast<uintptr_t>(v) & 15) == 0;
    uint4 st[kRowVecs];
    load_vecs(st, kp, sk, C, len, K, veck);
    chunk_gates(g, beta, p.start, len, HV, hv, G, Bt);
    vec_row_factors<T>(st, K, len, l2, rk);
    store_vecs(X, ldx, st, C, K);
    __syncthreads();
    if (tid < C) {
      Gout[ch * C + tid] = G[tid];
      fk[tid] = tid < len ? expf(G[C - 1] - G[tid]) * rk[tid] : 0.f;
    }

    // k k^T, lower tiles only (10 of 16; the rest is masked away below).
    for (int t = warp; t < 10; t += nwarps) {
      int ti = 0;
      while ((ti + 1) * (ti + 2) / 2 <= t) ++ti;
      const int tj = t - ti * (ti + 1) / 2;
      FragC acc;
      wmma::fill_fragment(acc, 0.f);
      for (int kk = 0; kk < K; kk += 16) {
        FragA<M> a;
        FragBt<M> b;
        wmma::load_matrix_sync(a, X + ti * 16 * ldx + kk, ldx);
        wmma::load_matrix_sync(b, X + tj * 16 * ldx + kk, ldx);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(At + ti * 16 * lda + tj * 16, acc, lda, wmma::mem_row_major);
    }
    __syncthreads();
    for (int e = tid; e < C * C; e += blockDim.x) {
      const int i = e / C, j = e % C;
      float& a = At[i * lda + j];
      a = i >= len  ? 0.f
          : j < i   ? Bt[i] * expf(G[i] - G[j]) * rk[i] * rk[j] * a
          : j == i  ? 1.f
                    : 0.f;
    }
    __syncthreads();
    // T = (I + A)^-1 in place, blocked (above the diagonal: scratch, not read).
    tri_inverse_blocked(At, lda);
    // T to registers (its region becomes T_hi / T_lo); K~ straight to global.
    float tv[kAccCC];
#pragma unroll
    for (int r = 0; r < kAccCC; ++r) {
      const int e = tid + r * kBlock;
      tv[r] = e % C <= e / C ? At[(e / C) * lda + e % C] : 0.f;  // T is lower triangular
    }
    {  // K~ = fk k, by 16-byte vectors (fk is 0 past len)
      M* kt = Ktout + ch * (int64_t)C * K;
      const int per = K / 8;
      for (int e = tid; e < C * per; e += blockDim.x) {
        const int i = e / per, c8 = (e % per) * 8;
        const uint4 raw = *reinterpret_cast<const uint4*>(X + i * ldx + c8);
        const M* xv = reinterpret_cast<const M*>(&raw);
        uint4 o;
        M* ov = reinterpret_cast<M*>(&o);
#pragma unroll
        for (int u = 0; u < 8; ++u) ov[u] = Mma<T>::from(fk[i] * Mma<T>::to(xv[u]));
        *reinterpret_cast<uint4*>(kt + i * K + c8) = o;
      }
    }
    if (tid < C) cs[tid] = Bt[tid] * expf(G[tid]) * rk[tid];
    __syncthreads();  // T read, cs ready

    // out = (T diag(cs)) x over the chunk's rows x (in X): T_hi x + T_lo x.
    auto apply = [&](int D, auto&& emit) {
#pragma unroll
      for (int r = 0; r < kAccCC; ++r) {
        const int e = tid + r * kBlock, i = e / C, j = e % C;
        const float t = tv[r] * cs[j];
        const M hi = Mma<T>::from(t);
        Thi[i * ldt + j] = hi;
        Tlo[i * ldt + j] = Mma<T>::from(t - Mma<T>::to(hi));
      }
      __syncthreads();
      const int nt = (C / 16) * (D / 16);
      for (int t = warp; t < nt; t += nwarps) {
        const int ti = t / (D / 16), tj = t % (D / 16);
        FragC acc;
        wmma::fill_fragment(acc, 0.f);
        for (int m = 0; m <= ti; ++m) {  // T is lower triangular
          FragA<M> ah, al;
          FragB<M> b;
          wmma::load_matrix_sync(b, X + m * 16 * ldx + tj * 16, ldx);
          wmma::load_matrix_sync(ah, Thi + ti * 16 * ldt + m * 16, ldt);
          wmma::load_matrix_sync(al, Tlo + ti * 16 * ldt + m * 16, ldt);
          wmma::mma_sync(acc, al, b, acc);
          wmma::mma_sync(acc, ah, b, acc);
        }
        emit(ti, tj, acc);
      }
    };
    M* wo = Wout + ch * (int64_t)C * K;
    apply(K, [&](int ti, int tj, const FragC& acc) {
      frag_out8<WS>(acc, scr, [&](int r, int c0, const float (&x)[8]) {
        uint4 o;
        M* ov = reinterpret_cast<M*>(&o);
#pragma unroll
        for (int u = 0; u < 8; ++u) ov[u] = Mma<T>::from(x[u]);
        *reinterpret_cast<uint4*>(wo + (ti * 16 + r) * K + tj * 16 + c0) = o;
      });
    });
    load_vecs(st, vp, sv, C, len, V, vecv);  // in flight across the barrier
    __syncthreads();  // X, T_hi, T_lo consumed
    store_vecs(X, ldx, st, C, V);
    if (tid < C) cs[tid] = Bt[tid];
    __syncthreads();
    float* uo = Uout + ch * (int64_t)C * V;
    apply(V, [&](int ti, int tj, const FragC& acc) {
      wmma::store_matrix_sync(uo + ti * 16 * V + tj * 16, acc, V, wmma::mem_row_major);
    });
  }
}

// (b) state pass, one block per (sequence, value head, vs = 16 rows of V), chunk by chunk.
// The block's h [vs, K] lives in float accumulator fragments for the whole walk (warp w owns
// tiles w, w + nwarps, ...), with a 16-bit copy in shared memory as the B operand of
//   v' = U - W h^T  (float accumulators started from U, stored 16-bit for the output pass),
//   h  = exp(G_last) h + v'^T K~.
// W and K~ (16-bit, [C, K]) of the next chunk load into registers and U (float) into
// fragments while the current chunk computes; both W and K~ then sit in shared memory for the
// chunk (three barriers per chunk). The 16-bit h entering each chunk goes to Hbuf. The walk
// is bound by each warp's instruction chain (ncu, 16K tokens: 0.33 issues per cycle per
// scheduler), so v' and h's 16-bit copies leave through frag_out8's 16-byte stores.
constexpr int kMmaVs = 16;
// v' enters the h update as v'_hi + v'_lo (two 16-bit halves, two products): with bf16 the
// single rounding of v' was the largest error of the final state (emulated multi case:
// 2.5e-3 -> 1.7e-3 vs float64; splitting h in v' = U - W h^T instead changed nothing).
constexpr bool kSplitV = true;
constexpr int kStage16 = kChunk * kMaxDim * 2 / 16 / kBlock;  // uint4 per thread per operand

// KD: the key dim as a template constant (32, 64 or 128). With K known, every row / column
// split of the staging loops is a shift and the tile loops unroll: with a runtime K, integer
// division and address arithmetic were half of the instructions on this serial path (ncu,
// 16K tokens: IMAD 27 %, HMMA 3 % of 107M issued).
// WS: the device's warp width (32 or 64, the host reads it), so the warp count, each warp's
// tile indices and fragment counts are constants too (with warpSize, a run-time value, every
// tile loop kept its bounds checks and index arithmetic on this serial path).
template <typename T, int KD, int WS>
__global__ void VO_GDN_BOUNDS gdn_chunk_state_mma_kernel(
    const int64_t* __restrict__ offs, int HV, int V, const float* __restrict__ Gbuf,
    const typename Mma<T>::type* __restrict__ Wbuf, const typename Mma<T>::type* __restrict__ Ktbuf,
    const float* __restrict__ Ubuf, typename Mma<T>::type* __restrict__ Vn,
    typename Mma<T>::type* __restrict__ Hbuf, const float* __restrict__ h0,
    float* __restrict__ final_state) {
  if constexpr (!mma_arch_ok<T>()) {
    __trap();
  } else {
    using M = typename Mma<T>::type;
    constexpr int C = kChunk, vs = kMmaVs, K = KD;
    VO_MMA_SMEM(smb);
    const StateLayout L(K, vs);
    M* buf = reinterpret_cast<M*>(smb);  // [C][K + 8]: W
    M* kb = reinterpret_cast<M*>(smb + L.kt);  // [C][K + 8]: K~
    M* hm = reinterpret_cast<M*>(smb + L.h);  // [vs][K + 8]
    M* vm = reinterpret_cast<M*>(smb + L.vn);  // [C][vs + 8]
    M* vlo = reinterpret_cast<M*>(smb + L.vlo);  // v' - vm
    constexpr int nwarps = kBlock / WS;
    const int warp = threadIdx.x / WS, lane = threadIdx.x % WS, tid = threadIdx.x;
    float* scr = reinterpret_cast<float*>(smb + L.scratch) + warp * kScrWarp;
    constexpr int ldk = pitch16(K), ldv = pitch16(vs);
    const int s = blockIdx.x, hv = blockIdx.y, v0 = blockIdx.z * vs;
    constexpr int nh = K / 16;  // h tiles (vs = 16: one tile row)
    // Fragments a warp keeps: h tiles, v' tiles (C / 16 of them).
    constexpr int kHF = (nh + nwarps - 1) / nwarps, kVF = (C / 16 + nwarps - 1) / nwarps;
    const int64_t state_off = ((int64_t)s * HV + hv) * V * K + (int64_t)v0 * K;

    FragC hf[kHF];
    // h0 through the scratch tile (the user's tensor need not be 32-byte aligned), and the
    // 16-bit copy.
    auto publish = [&](int r, int dt) {
      frag_out8<WS>(hf[r], scr, [&](int i, int c0, const float (&x)[8]) {
        uint4 u;  // 8 16-bit values
        M* y = reinterpret_cast<M*>(&u);
#pragma unroll
        for (int e = 0; e < 8; ++e) y[e] = Mma<T>::from(x[e]);
        *reinterpret_cast<uint4*>(hm + i * ldk + dt * 16 + c0) = u;
      });
    };
#pragma unroll
    for (int r = 0; r < kHF; ++r) {
      const int dt = warp + r * nwarps;
      if (dt < nh) {
        for (int e = lane; e < 256; e += WS)
          scr[e] = h0 != nullptr ? h0[state_off + (int64_t)(e / 16) * K + dt * 16 + e % 16] : 0.f;
        __syncwarp();
        wmma::load_matrix_sync(hf[r], scr, 16, wmma::mem_row_major);
        __syncwarp();
        publish(r, dt);
      }
    }

    const int64_t c_begin = offs[s], c_end = offs[s + 1];
    constexpr int n16 = C * K / 8;  // uint4 (8 16-bit elements) per operand
    uint4 stw[kStage16], stk[kStage16];  // W, K~ of the next chunk
    auto fetch = [&](uint4 (&stage)[kStage16], const M* src) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
#pragma unroll
      for (int r = 0; r < kStage16; ++r) {
        const int e = tid + r * kBlock;
        if (e < n16) stage[r] = s4[e];
      }
    };
    auto spill = [&](M* dst, const uint4 (&stage)[kStage16]) {
#pragma unroll
      for (int r = 0; r < kStage16; ++r) {
        const int e = tid + r * kBlock;
        if (e < n16) {
          const int row = e / (K / 8), col = (e % (K / 8)) * 8;
          *reinterpret_cast<uint4*>(dst + row * ldk + col) = stage[r];
        }
      }
    };
    if (c_begin < c_end) {
      fetch(stw, Wbuf + (c_begin * HV + hv) * (int64_t)C * K);
      fetch(stk, Ktbuf + (c_begin * HV + hv) * (int64_t)C * K);
    }
    constexpr int nv = C / 16;  // v' tiles (one column of tiles)
    // U of this warp's v' tiles and G_last, likewise one chunk ahead (un: the next chunk's).
    FragC un[kVF];
    float gn = 0.f;
    auto fetch_u = [&](int64_t ch) {
#pragma unroll
      for (int r = 0; r < kVF; ++r) {
        const int ti = warp + r * nwarps;
        if (ti < nv)
          wmma::load_matrix_sync(un[r], Ubuf + (ch * C + ti * 16) * V + v0, V,
                                 wmma::mem_row_major);
      }
      gn = Gbuf[ch * C + C - 1];
    };
    if (c_begin < c_end) fetch_u(c_begin * HV + hv);
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t ch = c * HV + hv;
      FragC vf[kVF];
#pragma unroll
      for (int r = 0; r < kVF; ++r) vf[r] = un[r];
      const float eg = expf(gn);
      if (c + 1 < c_end) fetch_u(ch + HV);
      __syncthreads();  // previous chunk done: buffers free, hm final
      spill(buf, stw);  // W and K~ of this chunk, loaded one chunk ago
      spill(kb, stk);
      {                 // the 16-bit state entering this chunk, for the output pass
        M* ho = Hbuf + ch * (int64_t)V * K + (int64_t)v0 * K;
        for (int e = tid; e < vs * K / 8; e += kBlock) {
          const int row = e / (K / 8), col = (e % (K / 8)) * 8;
          *reinterpret_cast<uint4*>(ho + row * K + col) =
              *reinterpret_cast<const uint4*>(hm + row * ldk + col);
        }
      }
      if (c + 1 < c_end) {  // the next chunk's, in flight during this one
        fetch(stw, Wbuf + (ch + HV) * (int64_t)C * K);
        fetch(stk, Ktbuf + (ch + HV) * (int64_t)C * K);
      }
      __syncthreads();

      // v' = U - W h^T: -(-U + W h^T) keeps mma_sync's add.
#pragma unroll
      for (int r = 0; r < kVF; ++r) {
        const int ti = warp + r * nwarps;
        if (ti < nv) {
          // Two accumulators (even / odd K tiles) halve the chain of dependent mma_syncs
          // on this serial path; same fragment type, so adding them element-wise is exact.
          FragC odd;
          wmma::fill_fragment(odd, 0.f);
          for (int e = 0; e < vf[r].num_elements; ++e) vf[r].x[e] = -vf[r].x[e];
          for (int kk = 0; kk < K; kk += 16) {
            FragA<M> a;
            FragBt<M> b;
            wmma::load_matrix_sync(a, buf + ti * 16 * ldk + kk, ldk);
            wmma::load_matrix_sync(b, hm + kk, ldk);
            if ((kk / 16) & 1) wmma::mma_sync(odd, a, b, odd);
            else wmma::mma_sync(vf[r], a, b, vf[r]);
          }
          for (int e = 0; e < vf[r].num_elements; ++e) vf[r].x[e] += odd.x[e];
          M* vo = Vn + (ch * C + ti * 16) * V + v0;
          frag_out8<WS>(vf[r], scr, [&](int i, int c0, const float (&x)[8]) {
            uint4 uh, ul;  // v' (16-bit) and v' - that, 8 values each
            M* yh = reinterpret_cast<M*>(&uh);
            M* yl = reinterpret_cast<M*>(&ul);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              yh[e] = Mma<T>::from(-x[e]);
              if (kSplitV) yl[e] = Mma<T>::from(-x[e] - Mma<T>::to(yh[e]));
            }
            *reinterpret_cast<uint4*>(vm + (ti * 16 + i) * ldv + c0) = uh;
            if (kSplitV) *reinterpret_cast<uint4*>(vlo + (ti * 16 + i) * ldv + c0) = ul;
            *reinterpret_cast<uint4*>(vo + i * V + c0) = uh;
          });
        }
      }
      __syncthreads();  // v' complete, h copy read

      // h = exp(G_last) h + v'^T K~ (each warp its own tiles; then their 16-bit copies).
#pragma unroll
      for (int r = 0; r < kHF; ++r) {
        const int dt = warp + r * nwarps;
        if (dt < nh) {
          FragC lo;  // the v'_lo products, a second (independent) accumulator
          wmma::fill_fragment(lo, 0.f);
          for (int e = 0; e < hf[r].num_elements; ++e) hf[r].x[e] *= eg;
          for (int m = 0; m < C; m += 16) {
            FragAt<M> a;
            FragB<M> b;
            wmma::load_matrix_sync(a, vm + m * ldv, ldv);
            wmma::load_matrix_sync(b, kb + m * ldk + dt * 16, ldk);
            if (kSplitV) {
              FragAt<M> al;
              wmma::load_matrix_sync(al, vlo + m * ldv, ldv);
              wmma::mma_sync(lo, al, b, lo);
            }
            wmma::mma_sync(hf[r], a, b, hf[r]);
          }
          for (int e = 0; e < hf[r].num_elements; ++e) hf[r].x[e] += lo.x[e];
          publish(r, dt);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kHF; ++r) {
      const int dt = warp + r * nwarps;
      if (dt < nh)
        wmma::store_matrix_sync(final_state + state_off + dt * 16, hf[r], K,
                                wmma::mem_row_major);
    }
  }
}

// (c) output, one block per (chunk slot, value head):
//   S = lower(Gamma) * (rq rk^T scale) * (q k^T)   (raw q / k operands; factors in float,
//       then S rounded to 16 bits),
//   o = diag(exp(G) rq scale) (q h^T) + S v'.
// q, k, h and v' (16-bit) are all staged in shared memory at the start with 16-byte loads
// (all in flight together; the l2 norms come from the same registers), so every B fragment is
// a shared-memory load. A warp owns one 16-row strip of the output: its q A fragments (all of
// K) and its row of S fragments stay in registers across the strip's column tiles. The row
// factor is applied to q h^T in float, element-wise, with an accumulator fragment loaded
// from a [16, 16] tile of the strip's factors (R[r][c] = rf[r]): the same fragment type has
// the same element -> (row, col) map, so no scratch round trip; then S v' accumulates on top.
// Output tiles leave through frag_out8 as 16-byte stores.
constexpr int kSFrags = (10 + kBlock / 64 - 1) / (kBlock / 64);  // lower S tiles per warp

template <typename T, int KD, int VD, int WS>
__global__ void VO_GDN_BOUNDS2 gdn_chunk_output_mma_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const int64_t* __restrict__ cu,
    const int64_t* __restrict__ offs, int N, int H, int HV, int K_, int V_, float scale, bool l2,
    const float* __restrict__ Gbuf, const typename Mma<T>::type* __restrict__ Vn,
    const typename Mma<T>::type* __restrict__ Hbuf, T* __restrict__ out) {
  if constexpr (!mma_arch_ok<T>()) {
    __trap();
  } else {
    using M = typename Mma<T>::type;
    constexpr int C = kChunk;
    const int K = KD ? KD : K_, V = VD ? VD : V_;  // see kDimsFixed
    VO_MMA_SMEM(smb);
    const OutLayout L(K, V);
    float* G = reinterpret_cast<float*>(smb);
    float* rq = G + C;
    float* rk = rq + C;
    float* Rt = reinterpret_cast<float*>(smb + L.rt);  // [C][16]: rf of row i, 16 times
    M* qs = reinterpret_cast<M*>(smb + L.q);
    M* ks = reinterpret_cast<M*>(smb + L.k);
    M* Sm = reinterpret_cast<M*>(smb + L.s);  // over ks once S is in registers
    M* hs = reinterpret_cast<M*>(smb + L.h);
    M* vs = reinterpret_cast<M*>(smb + L.vn);
    constexpr int nwarps = kBlock / WS;  // WS: as the state pass's (below)
    const int warp = threadIdx.x / WS;
    float* scr = reinterpret_cast<float*>(smb + L.scratch) + warp * kScrWarp;
    const int ldk = pitch16(K), lds = pitch16(C), ldv = pitch16(V);
    const int64_t c = blockIdx.x;
    const int hv = blockIdx.y, kh = hv / (HV / H), tid = threadIdx.x;
    ChunkPos p;
    if (!chunk_pos(cu, offs, N, c, p)) return;
    const int len = p.len;
    const int64_t sk = (int64_t)H * K, ch = c * HV + hv;
    const T* qp = q + p.start * sk + (int64_t)kh * K;
    const T* kp = k + p.start * sk + (int64_t)kh * K;
    // q, k are the caller's tensors (a view need not be 16-byte aligned); h, v' are ours.
    const bool vec = ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k)) & 15) == 0;
    uint4 sq[kRowVecs], skv[kRowVecs], sh[kStateVecs], sv[kRowVecs];
    load_vecs(sq, qp, sk, C, len, K, vec);
    load_vecs(skv, kp, sk, C, len, K, vec);
    load_vecs(sh, Hbuf + ch * (int64_t)V * K, K, V, V, K, true);
    load_vecs(sv, Vn + ch * (int64_t)C * V, V, C, C, V, true);
    if (tid < C) G[tid] = Gbuf[ch * C + tid];
    vec_row_factors<T>(sq, K, len, l2, rq);
    vec_row_factors<T>(skv, K, len, l2, rk);
    store_vecs(qs, ldk, sq, C, K);
    store_vecs(ks, ldk, skv, C, K);
    store_vecs(hs, ldk, sh, V, K);
    store_vecs(vs, ldv, sv, C, V);
    __syncthreads();
    for (int e = tid; e < C * 16; e += blockDim.x) {  // rf = exp(G) rq scale, per row
      const int i = e / 16;
      Rt[e] = expf(G[i]) * rq[i] * scale;
    }

    // q k^T, lower tiles, kept in registers until every warp is done with ks (tiles wholly in
    // padded rows are never read: skipped).
    FragC sf[kSFrags];
#pragma unroll
    for (int r = 0; r < kSFrags; ++r) {
      const int t = warp + r * nwarps;
      int ti = 0;
      while ((ti + 1) * (ti + 2) / 2 <= t) ++ti;
      const int tj = t - ti * (ti + 1) / 2;
      if (t < 10 && ti * 16 < len) {
        wmma::fill_fragment(sf[r], 0.f);
        for (int kk = 0; kk < K; kk += 16) {
          FragA<M> a;
          FragBt<M> b;
          wmma::load_matrix_sync(a, qs + ti * 16 * ldk + kk, ldk);
          wmma::load_matrix_sync(b, ks + tj * 16 * ldk + kk, ldk);
          wmma::mma_sync(sf[r], a, b, sf[r]);
        }
      }
    }
    __syncthreads();  // ks consumed: S goes over it
#pragma unroll
    for (int r = 0; r < kSFrags; ++r) {
      const int t = warp + r * nwarps;
      int ti = 0;
      while ((ti + 1) * (ti + 2) / 2 <= t) ++ti;
      const int tj = t - ti * (ti + 1) / 2;
      if (t < 10 && ti * 16 < len) {
        frag_out8<WS>(sf[r], scr, [&](int a, int b0, const float (&x)[8]) {
          const int i = ti * 16 + a, j0 = tj * 16 + b0;
          uint4 u;  // 8 16-bit values of S row i
          M* y = reinterpret_cast<M*>(&u);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const int j = j0 + e;
            y[e] = Mma<T>::from(
                j <= i && i < len ? expf(G[i] - G[j]) * rq[i] * rk[j] * scale * x[e] : 0.f);
          }
          *reinterpret_cast<uint4*>(Sm + i * lds + j0) = u;
        });
      }
    }
    __syncthreads();  // S and the row-factor tiles complete

    // Warp w owns row strip w % nrs (strips w, w + nwarps, ... with fewer warps than strips)
    // and, with wg warps per strip, column tiles w / nrs, + wg, ...
    constexpr int nrs = C / 16;
    const int nvt = V / 16, nk = K / 16;
    const int wg = nwarps >= nrs ? nwarps / nrs : 1;
    const int64_t so = (int64_t)HV * V;
    T* op = out + p.start * so + (int64_t)hv * V;
    for (int ti = warp % nrs; ti < nrs && warp < nrs * wg; ti += nwarps) {
      if (ti * 16 >= len) break;  // padded rows only, as are the later strips (warp-uniform)
      FragA<M> qa[kMaxDim / 16], sa[nrs];
#pragma unroll
      for (int kk = 0; kk < kMaxDim / 16; ++kk)
        if (kk < nk) wmma::load_matrix_sync(qa[kk], qs + ti * 16 * ldk + kk * 16, ldk);
#pragma unroll
      for (int m = 0; m < nrs; ++m)
        if (m <= ti) wmma::load_matrix_sync(sa[m], Sm + ti * 16 * lds + m * 16, lds);
      FragC rt;
      wmma::load_matrix_sync(rt, Rt + ti * 256, 16, wmma::mem_row_major);
      for (int tj = warp / nrs; tj < nvt; tj += wg) {
        // q h^T, B(kk, j) = h[j][kk]: even / odd K tiles in two accumulators (two
        // independent mma chains), then rf per row, then + S v' (S is 0 above the diagonal).
        FragC acc, odd;
        wmma::fill_fragment(acc, 0.f);
        wmma::fill_fragment(odd, 0.f);
#pragma unroll
        for (int kk = 0; kk < kMaxDim / 16; ++kk) {
          if (kk < nk) {
            FragBt<M> b;
            wmma::load_matrix_sync(b, hs + tj * 16 * ldk + kk * 16, ldk);
            if (kk & 1) wmma::mma_sync(odd, qa[kk], b, odd);
            else wmma::mma_sync(acc, qa[kk], b, acc);
          }
        }
        for (int e = 0; e < acc.num_elements; ++e) acc.x[e] = (acc.x[e] + odd.x[e]) * rt.x[e];
#pragma unroll
        for (int m = 0; m < nrs; ++m) {
          if (m <= ti) {
            FragB<M> b;
            wmma::load_matrix_sync(b, vs + m * 16 * ldv + tj * 16, ldv);
            wmma::mma_sync(acc, sa[m], b, acc);
          }
        }
        frag_out8<WS>(acc, scr, [&](int a, int c0, const float (&x)[8]) {
          const int i = ti * 16 + a;
          if (i < len) store_vec(op + i * so + tj * 16 + c0, x);
        });
      }
    }
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

// Whether the tensor-core kernels' shared memory fits a device granting `limit` bytes a block.
bool mma_fits(int K, int V, int64_t limit) {
  return PrepLayout(K, V).total <= limit && StateLayout(K, kMmaVs).total <= limit &&
         OutLayout(K, V).total <= limit;
}

// Which kernels a call runs and the shared memory each block asks for. The tensor-core kernels
// (16-bit inputs) where the device grants their shared memory (48-94 KB at K = V = 128) and
// wmma is not switched off (VO_KERNELS_WMMA=0: a device without NVIDIA's 16x16x16 fragments);
// else the float32 FMA kernels, which take 16-bit inputs too and fit 32 KB (their state pass
// in two row blocks of W / K~ where one does not fit).
struct GdnPlan {
  bool mma;
  int nh;
  size_t fa, fb, fc;  // float32 path: prep, state, output bytes
  int64_t limit;
  GdnPlan(const at::Tensor& q, int K, int V, int vs) {
    limit = VO_SMEM_OPTIN(q);
    mma = q.scalar_type() != at::kFloat && wmma_enabled() && mma_fits(K, V, limit);
    const int D = std::max(K, V);
    fa = (4 * kChunk + kChunk * (kChunk + 1) + std::max(kChunk * (kTile + 1), kTile * (D + 1))) *
         sizeof(float);
    auto state = [&](int n) {
      return (vs * (K + 1) + kChunk * (vs + 1) + kChunk / n * (K + 1)) * sizeof(float);
    };
    nh = static_cast<int64_t>(state(1)) <= limit ? 1 : 2;
    fb = state(nh);
    fc = (3 * kChunk + kChunk * (kChunk + 1) +
          std::max({2 * kChunk * (kTile + 1), (kChunk + V) * (kTile + 1), kTile * (V + 1)})) *
         sizeof(float);
  }
  std::string describe(int K, int V) const {
    if (mma)
      return "tensor-core kernels (wmma 16x16x16), shared memory a block: prep " +
             std::to_string(PrepLayout(K, V).total) + ", state " +
             std::to_string(StateLayout(K, kMmaVs).total) + ", output " +
             std::to_string(OutLayout(K, V).total) + " bytes";
    return "float32 FMA kernels, shared memory a block: prep " + std::to_string(fa) +
           ", state " + std::to_string(fb) + (nh > 1 ? " (two row blocks)" : "") + ", output " +
           std::to_string(fc) + " bytes (device allows " + std::to_string(limit) + ")";
  }
};

// The plan of a call on q's device in words (kernels.py logs it with the op's path).
std::string gdn_chunk_plan(const at::Tensor& q, int64_t K, int64_t V) {
  const GdnPlan plan(q, K, V, kMaxVSplit);
  if (!wmma_enabled()) return plan.describe(K, V) + "; VO_KERNELS_WMMA=0";
  return plan.describe(K, V);
}

// The tensor-core path's buffers and launches (fp16 / bf16 inputs only).
template <typename T>
void launch_mma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& g, const at::Tensor& beta, const int64_t* cup,
                const int64_t* offp, int N, int H, int HV, int K, int V, int64_t slots,
                int64_t ntok, double scale, bool l2norm, const float* h0p, at::Tensor& out,
                at::Tensor& fin) {
  if constexpr (std::is_same<T, float>::value) {
    TORCH_CHECK(false, "gdn_chunk_prefill: no tensor-core path for float32");
  } else {
    using M = typename Mma<T>::type;
    auto f32 = q.options().dtype(at::kFloat);
    auto h16 = q.options();  // 16-bit buffers in the input's own type
    auto Gb = at::empty({slots, HV, kChunk}, f32);
    auto Wb = at::empty({slots, HV, kChunk, K}, h16);
    auto Kt = at::empty({slots, HV, kChunk, K}, h16);  // K~ rows
    auto Ub = at::empty({slots, HV, kChunk, V}, f32);
    auto Vn = at::empty({slots, HV, kChunk, V}, h16);  // v'
    auto Hb = at::empty({slots, HV, V, K}, h16);       // h entering each chunk
    auto m16 = [](at::Tensor& t) { return reinterpret_cast<M*>(t.data_ptr<T>()); };
    const PrepLayout la(K, V);
    const StateLayout lb(K, kMmaVs);
    const OutLayout lc(K, V);
    const bool fixed = K == kDimsFixed && V == kDimsFixed;
    const bool chunks = slots > 0 && ntok > 0;  // else only the state pass (h0 -> final)
    auto prep = [&](auto kernel) {
      VO_SMEM_OPT_IN(kernel, la.total);  // 48.25 KB for K = V = 128
      VO_LAUNCH(kernel, dim3(slots, HV), kBlock, la.total, k.data_ptr<T>(), v.data_ptr<T>(),
          g.data_ptr<float>(), beta.data_ptr<float>(), cup, offp, N, H, HV, K, V, l2norm,
          Gb.data_ptr<float>(), m16(Wb), Ub.data_ptr<float>(), m16(Kt));
    };
    auto state_pass = [&](auto kernel) {
      VO_SMEM_OPT_IN(kernel, lb.total);  // W and K~ both resident: 56 KB for K = 128
      VO_LAUNCH(kernel, dim3(N, HV, V / kMmaVs), kBlock, lb.total, offp, HV, V,
          Gb.data_ptr<float>(), m16(Wb), m16(Kt), Ub.data_ptr<float>(), m16(Vn), m16(Hb), h0p,
          fin.data_ptr<float>());
    };
    auto output = [&](auto kernel) {
      // q, k, h and v' all staged: 94 KB for K = V = 128 (two blocks per SM on an H200).
      VO_SMEM_OPT_IN(kernel, lc.total);
      VO_LAUNCH(kernel, dim3(slots, HV), kBlock, lc.total, q.data_ptr<T>(), k.data_ptr<T>(),
          cup, offp, N, H, HV, K, V, static_cast<float>(scale), l2norm, Gb.data_ptr<float>(),
          m16(Vn), m16(Hb), out.data_ptr<T>());
    };
    // All three kernels take the device's warp width as a template constant: one dispatch.
    with_warp_width(q, "gdn_chunk_prefill", [&](auto width) {
      constexpr int W = decltype(width)::value;
      if (chunks) {
        if (fixed) prep(gdn_chunk_prep_mma_kernel<T, kDimsFixed, kDimsFixed, W>);
        else prep(gdn_chunk_prep_mma_kernel<T, 0, 0, W>);
      }
      if (K == 128) state_pass(gdn_chunk_state_mma_kernel<T, 128, W>);
      else if (K == 64) state_pass(gdn_chunk_state_mma_kernel<T, 64, W>);
      else state_pass(gdn_chunk_state_mma_kernel<T, 32, W>);
      if (chunks) {
        if (fixed) output(gdn_chunk_output_mma_kernel<T, kDimsFixed, kDimsFixed, W>);
        else output(gdn_chunk_output_mma_kernel<T, 0, 0, W>);
      }
    });
  }
}

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
  // fp16 / bf16 take the tensor-core kernels (bf16 needs sm_80); float32 keeps the float32
  // FMA kernels (16-bit operands would miss its accuracy).
  bool mma = q.scalar_type() != at::kFloat;
#ifndef VO_CPU_EMULATION
  if (q.scalar_type() == at::kBFloat16) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                          q.device().index()));
    if (major < 8) mma = false;
  }
#endif
  const GdnPlan plan(q, K, V, vs);
  mma = mma && plan.mma;
  const size_t smem_a = plan.fa, smem_b = plan.fb, smem_c = plan.fc;
  const int nh = plan.nh;
  const float* h0p = h0.has_value() ? h0->data_ptr<float>() : nullptr;
  VO_DISPATCH_FLOATS(q.scalar_type(), "gdn_chunk_prefill", [&] {
    using T_ = scalar_t;
    if (mma) {
      launch_mma<T_>(qc, kc, vc, gc, bc, cup, offp, N, H, HV, K, V, slots, T, scale, l2norm,
                     h0p, out, fin);
      return;
    }
    auto f32 = q.options().dtype(at::kFloat);
    auto Gb = at::empty({slots, HV, kChunk}, f32);
    auto Wb = at::empty({slots, HV, kChunk, K}, f32);
    auto Ub = at::empty({slots, HV, kChunk, V}, f32);  // U, then v'
    auto Hb = at::empty({slots, HV, V, K}, f32);
    auto Kt = at::empty({slots, HV, kChunk, K}, f32);  // K~ rows
    if (slots > 0 && T > 0) {
      VO_LAUNCH(gdn_chunk_prep_kernel<T_>, dim3(slots, HV), kBlock, smem_a,
          kc.data_ptr<T_>(), vc.data_ptr<T_>(), gc.data_ptr<float>(), bc.data_ptr<float>(),
          cup, offp, N, H, HV, K, V, l2norm, Gb.data_ptr<float>(), Wb.data_ptr<float>(),
          Ub.data_ptr<float>(), Kt.data_ptr<float>());
    }
    VO_SMEM_OPT_IN(gdn_chunk_state_kernel, smem_b);
    VO_LAUNCH(gdn_chunk_state_kernel, dim3(N, HV, V / vs), kBlock, smem_b,
        offp, HV, K, V, vs, nh, Gb.data_ptr<float>(), Wb.data_ptr<float>(), Kt.data_ptr<float>(),
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
  m.def("gdn_chunk_plan(Tensor q, int K, int V) -> str");
  m.def("gdn_chunk_prefill(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,"
        " Tensor cu_seqlens, Tensor? initial_state, float scale, bool l2norm, int v_split)"
        " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vo_kernels, VO_DISPATCH_KEY, m) {
  m.impl("gdn_chunk_prefill", &gdn_chunk_prefill);
  m.impl("gdn_chunk_plan", &gdn_chunk_plan);
}
