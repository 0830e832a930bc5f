// Paged attention kernels (vllm_overrides.native.kernels.paged_decode_attention /
// paged_prefill_attention / paged_write_kv) over our KV cache layout: per layer
// [2, num_blocks, kv_heads, block_size, D] (paged_attention.py says why), keys at [0], values at
// [1]; token t of a sequence lives in block table[t / block_size] at offset t % block_size, and
// one head's block is a contiguous [block_size, D] tile.
//
// * write_kv (1 launch): the new tokens' key / value rows to their slots; negative slots
//   (vLLM's padding) skipped on the device, so no host sync.
// * decode (1 launch, + 1 combine when the context is split): one query token per sequence.
//   Block (partition p, kv head, sequence) takes the G = H / KV query heads that share the kv
//   head over `part` context tokens: scores by groups of kLanes lanes per key row (16-byte
//   loads of the row, G dot products, a group sum), the partition's softmax in shared memory,
//   then P V with each thread owning one 16-byte column vector of D for a slice of the tokens.
//   A partition's (max, sum of exp, unnormalised P V) go to float32 partials, merged by the
//   combine kernel (log-sum-exp) -- or, when one partition covers the context, the block
//   writes the normalised output itself and there is no second launch.
// * prefill (1 launch): a chunk of new tokens per sequence (varlen) over its cached context,
//   causal inside the chunk. Block (query tile, sequence x kv head) holds kPaRows = 64 query rows
//   (64 / G tokens x the G heads of the kv head, so every key tile is read once for the whole
//   group) and walks the key tiles of kPaKeys = 64 keys -- context keys through the block table,
//   then the chunk's own keys from the key / value arguments (with a prefix-cache hit vLLM
//   0.6.3 hands a table of the cached blocks only) -- with an online softmax. Products are
//   float32 FMA over shared-memory tiles (no wmma: the target's fragment shapes differ from
//   NVIDIA's), each thread a 4 x kPaTK score tile and a 4 x kPaTC output tile in registers.
//
// Portability as in common.cuh: no warp width assumed (lane groups of 16 or fewer, block-wide
// reductions through shared memory), float32 accumulation, no float64 on the device; shared
// memory per block: decode (2 G D + G part) floats + 1 KB (17 KB at G = 4, D = 256, part =
// 512), prefill 27 KB at any D -- both under the card's 32 KB; the host checks the device's
// limit (VO_SMEM_OPTIN) before a launch and refuses rather than launch what cannot run.
#include "common.cuh"

// The prefill kernel is written for exactly kBlock threads (its register tiles are
// compile-time): telling the compiler lets it budget registers for that block size.
#ifdef VO_CPU_EMULATION
#define VO_PA_BOUNDS
#else
#define VO_PA_BOUNDS __launch_bounds__(kBlock)
#endif

namespace {

constexpr int kPaMaxG = 8;    // query heads per kv head the kernels take (Qwen3.6: 4 at TP 4)
constexpr int kPaLanes = 8;  // lanes per key row in the decode score pass (divides any warp)

__device__ __forceinline__ float warp_max(float v) {
  for (int o = warpSize / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(__activemask(), v, o));
  return v;
}

__device__ __forceinline__ float group_max(float v, int width) {
  for (int o = width / 2; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(__activemask(), v, o, width));
  return v;
}

// Block-wide max of N values per thread (valid in every thread); `red` holds N * kMaxWarps.
template <int N>
__device__ __forceinline__ void block_max(float (&v)[N], float* red) {
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int nwarps = (blockDim.x + warpSize - 1) / warpSize;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_max(v[i]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) red[i * kMaxWarps + warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float s = -INFINITY;
    for (int w = 0; w < nwarps; ++w) s = fmaxf(s, red[i * kMaxWarps + w]);
    v[i] = s;
  }
}

// exp(x - m) for a running max m that may still be -inf (no key seen): 0, never NaN.
__device__ __forceinline__ float exp_sub(float x, float m) {
  return m == -INFINITY ? 0.f : expf(x - m);
}

// ------------------------------------------------------------------------------------------
// write_kv
// ------------------------------------------------------------------------------------------

// One thread per element of the new rows (a decode step writes KV * D elements, a prefill
// chunk T * KV * D: either way far below the attention itself).
template <typename T, typename S>
__global__ void pa_write_kv_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                   int64_t ks_tok, int64_t ks_head, int64_t vs_tok,
                                   int64_t vs_head, T* __restrict__ kc, T* __restrict__ vc,
                                   const S* __restrict__ slots, int64_t rows, int KV, int D,
                                   int bs) {
  const int64_t n = rows * KV * D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int d = i % D;
    const int h = (i / D) % KV;
    const int64_t t = i / ((int64_t)D * KV);
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0) continue;
    const int64_t dst = ((slot / bs * KV + h) * bs + slot % bs) * D + d;
    kc[dst] = key[t * ks_tok + h * ks_head + d];
    vc[dst] = value[t * vs_tok + h * vs_head + d];
  }
}

// ------------------------------------------------------------------------------------------
// decode
// ------------------------------------------------------------------------------------------

// Shared memory of a decode block, in floats: q [G, D] | scores [G, part] | P V sums [G, D] |
// reduction scratch.
__host__ __device__ inline int64_t decode_smem_floats(int G, int D, int part) {
  return 2LL * G * D + (int64_t)G * part + kPaMaxG * kMaxWarps;
}

// G (query heads of the kv head) is a template constant: the per-head arrays stay in registers
// at their real size. Score pass: lane group `grp` (kPaLanes lanes) takes key rows in pairs,
// both rows' 16-byte loads issued before any product (more bytes in flight per lane: the pass
// is latency-bound otherwise); P V: each thread four tokens a step, loads first.
template <typename T, int G>
__global__ void pa_decode_kernel(const T* __restrict__ q, int64_t q_seq, const T* __restrict__ kc,
                                 const T* __restrict__ vc, const int* __restrict__ tables,
                                 int64_t table_stride, const int* __restrict__ seq_lens,
                                 float scale, int KV, int D, int bs, int part, int num_parts,
                                 T* __restrict__ out, float* __restrict__ pm,
                                 float* __restrict__ pl, float* __restrict__ pacc) {
  VO_DYN_SMEM(float, sm);
  const int p = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int H = KV * G;
  const int len = seq_lens[b];
  const int t0 = p * part;
  const bool direct = num_parts == 1;
  if (t0 >= len && !(direct && len <= 0)) return;  // past the context: the combine skips it
  const int n = len > t0 ? min(part, len - t0) : 0;
  float* qs = sm;                     // [G, D], scaled
  float* sc = qs + G * D;             // [G, part]: scores, then exp(score - max)
  float* pv = sc + G * part;          // [G, D]: P V summed over the token lanes
  float* red = pv + G * D;            // [kPaMaxG * kMaxWarps]
  const int tid = threadIdx.x;
  const T* qb = q + b * q_seq + (int64_t)kvh * G * D;
  for (int i = tid; i < G * D; i += blockDim.x) qs[i] = to_f(qb[i]) * scale;
  for (int i = tid; i < G * D; i += blockDim.x) pv[i] = 0.f;
  __syncthreads();

  const int* table = tables + b * table_stride;
  constexpr int V = Vec<T>::N;
  const int dv = D / V;  // 16-byte vectors a row
  auto row_of = [&](const T* cache, int j) {
    const int t = t0 + j;
    return cache + (((int64_t)table[t / bs] * KV + kvh) * bs + t % bs) * D;
  };
  // Scores: every lane of a warp runs the same number of rounds (the group sum is a shuffle
  // every lane must reach); a round is two rows a group.
  {
    const int ngroups = blockDim.x / kPaLanes, grp = tid / kPaLanes, gl = tid % kPaLanes;
    const int rounds = (n + 2 * ngroups - 1) / (2 * ngroups);
    for (int r = 0; r < rounds; ++r) {
      const int j0 = (r * ngroups + grp) * 2;
      float s0[G], s1[G];
#pragma unroll
      for (int g = 0; g < G; ++g) s0[g] = s1[g] = 0.f;
      const T* row0 = j0 < n ? row_of(kc, j0) : nullptr;
      const T* row1 = j0 + 1 < n ? row_of(kc, j0 + 1) : nullptr;
      for (int c = gl; c < dv; c += kPaLanes) {
        Vec<T> k0, k1;
        if (row0 != nullptr) k0.load(row0 + c * V);
        if (row1 != nullptr) k1.load(row1 + c * V);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float* qg = qs + g * D + c * V;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            if (row0 != nullptr) s0[g] += qg[e] * k0.f[e];
            if (row1 != nullptr) s1[g] += qg[e] * k1.f[e];
          }
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        s0[g] = group_sum(s0[g], kPaLanes);
        s1[g] = group_sum(s1[g], kPaLanes);
      }
      if (gl == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (row0 != nullptr) sc[g * part + j0] = s0[g];
          if (row1 != nullptr) sc[g * part + j0 + 1] = s1[g];
        }
      }
    }
  }
  __syncthreads();
  // The partition's softmax per head: max, then exp in place, then the sum.
  float mx[G], den[G];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    mx[g] = -INFINITY;
    for (int j = tid; j < n; j += blockDim.x) mx[g] = fmaxf(mx[g], sc[g * part + j]);
  }
  block_max<G>(mx, red);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    den[g] = 0.f;
    for (int j = tid; j < n; j += blockDim.x) {
      const float e = exp_sub(sc[g * part + j], mx[g]);
      sc[g * part + j] = e;
      den[g] += e;
    }
  }
  block_sum<G>(den, red);  // starts with a barrier: the exp values are visible after it
  // P V: thread = (token lane tl, 16-byte column c), four tokens a step; the token lanes' sums
  // go through `pv` one lane at a time (a fixed order: the result does not depend on
  // scheduling).
  const int lanes = blockDim.x / dv, tl = tid / dv, c = tid % dv;
  if (tl < lanes) {
    float acc[G][V];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < V; ++e) acc[g][e] = 0.f;
    constexpr int kU = 4;
    for (int j0 = tl; j0 < n; j0 += kU * lanes) {
      Vec<T> vv[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int j = j0 + u * lanes;
        if (j < n) vv[u].load(row_of(vc, j) + c * V);
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int j = j0 + u * lanes;
        if (j < n) {
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float w = sc[g * part + j];
#pragma unroll
            for (int e = 0; e < V; ++e) acc[g][e] += w * vv[u].f[e];
          }
        }
      }
    }
    for (int r = 0; r < lanes; ++r) {
      if (r == tl) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
          for (int e = 0; e < V; ++e) pv[g * D + c * V + e] += acc[g][e];
      }
      __syncthreads();
    }
  } else {
    for (int r = 0; r < lanes; ++r) __syncthreads();
  }
  if (direct) {
    for (int i = tid; i < G * D; i += blockDim.x) {
      const int g = i / D;
      float d = 0.f;
#pragma unroll
      for (int gg = 0; gg < G; ++gg)
        if (gg == g) d = den[gg];
      out[b * (int64_t)H * D + (int64_t)kvh * G * D + i] =
          static_cast<T>(d > 0.f ? pv[i] / d : 0.f);
    }
    return;
  }
  for (int i = tid; i < G * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    pacc[((int64_t)(b * H + kvh * G + g) * num_parts + p) * D + d] = pv[i];
  }
  if (tid < G) {
    float m = 0.f, l = 0.f;
#pragma unroll
    for (int g = 0; g < G; ++g)
      if (g == tid) {
        m = mx[g];
        l = den[g];
      }
    pm[(int64_t)(b * H + kvh * G + tid) * num_parts + p] = m;
    pl[(int64_t)(b * H + kvh * G + tid) * num_parts + p] = l;
  }
}

// Merge of one (sequence, head)'s partitions: weights exp(m_p - max) in shared memory, then
// each thread one output column over the partitions. Shared: num_parts + kMaxWarps floats.
template <typename T>
__global__ void pa_decode_combine_kernel(const float* __restrict__ pm,
                                         const float* __restrict__ pl,
                                         const float* __restrict__ pacc,
                                         const int* __restrict__ seq_lens, int D, int part,
                                         int num_parts, T* __restrict__ out) {
  VO_DYN_SMEM(float, sm);
  const int h = blockIdx.x, b = blockIdx.y, H = gridDim.x;
  const int len = seq_lens[b];
  const int np = len > 0 ? min(num_parts, (len + part - 1) / part) : 0;
  const int64_t row = (int64_t)b * H + h;
  float* w = sm;
  float* red = sm + num_parts;
  float m[1] = {-INFINITY};
  for (int p = threadIdx.x; p < np; p += blockDim.x) m[0] = fmaxf(m[0], pm[row * num_parts + p]);
  block_max<1>(m, red);
  float tot[1] = {0.f};
  for (int p = threadIdx.x; p < np; p += blockDim.x) {
    const float e = exp_sub(pm[row * num_parts + p], m[0]);
    w[p] = e;
    tot[0] += e * pl[row * num_parts + p];
  }
  block_sum<1>(tot, red);  // its leading barrier publishes w
  const float inv = tot[0] > 0.f ? 1.f / tot[0] : 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float s = 0.f;
    for (int p = 0; p < np; ++p) s += w[p] * pacc[(row * num_parts + p) * D + d];
    out[row * D + d] = static_cast<T>(s * inv);
  }
}

// ------------------------------------------------------------------------------------------
// prefill
// ------------------------------------------------------------------------------------------

constexpr int kPaRows = 64;   // query rows a block (tokens x the kv head's G query heads)
constexpr int kPaKeys = 64;   // keys a tile
constexpr int kPaDk = 16;     // D columns a step of the score product
constexpr int kPaLdQK = kPaDk + 4;  // Q / K step pitch: float4 rows, 8 consecutive rows on 8 banks
constexpr int kPaLdS = kPaKeys + 1;
constexpr int kPaRowGroups = 16;  // threads along the rows: each thread 4 rows r, r + 16, ...
constexpr int kPaTR = kPaRows / kPaRowGroups;                    // 4 rows a thread
constexpr int kPaColThreads = kBlock / kPaRowGroups;           // threads along keys / D columns
constexpr int kPaTK = kPaKeys / kPaColThreads;                   // keys a thread (4 at 256 threads)
static_assert(kPaKeys % kPaColThreads == 0 && kBlock % kPaRows == 0 && kBlock / kPaRows <= 16,
              "prefill tile shape");
// Shared layout (floats): [Q step | K step] (reused for V rows) | S | row m, l, alpha.
constexpr int kPaQKFloats = (kPaRows + kPaKeys) * kPaLdQK;
constexpr int kPaPrefillSmemFloats = kPaQKFloats + kPaRows * kPaLdS + 3 * kPaRows;

// V rows a step of the prefill's P V product: the largest power of two whose [rows, D] float
// tile fits over the Q / K step area.
__host__ __device__ constexpr int pa_v_keys(int D) {
  int n = 1;
  while (2 * n * D <= kPaQKFloats) n *= 2;
  return n;
}

// kPaDk elements of a row (16-byte loads) into shared memory as float32, times `mul`.
template <typename T>
__device__ __forceinline__ void load_run(const T* __restrict__ src, float* __restrict__ dst,
                                         float mul) {
  constexpr int V = Vec<T>::N;
#pragma unroll
  for (int c = 0; c < kPaDk; c += V) {
    Vec<T> x;
    x.load(src + c);
#pragma unroll
    for (int e = 0; e < V; ++e) dst[c + e] = x.f[e] * mul;
  }
}

template <typename T, int D>
__global__ void VO_PA_BOUNDS pa_prefill_kernel(const T* __restrict__ q, int64_t q_tok, const T* __restrict__ knew,
                  const T* __restrict__ vnew, int64_t kv_tok, const T* __restrict__ kc,
                  const T* __restrict__ vc, const int* __restrict__ tables, int64_t table_stride,
                  const int* __restrict__ cu_q, const int* __restrict__ ctx_lens, int KV, int G,
                  int bs, float scale, T* __restrict__ out, int64_t o_tok) {
  VO_DYN_SMEM(float, sm);
  constexpr int kPaTC = D / kPaColThreads;  // output columns a thread
  static_assert(D % kPaColThreads == 0 && D % kPaDk == 0, "head size");
  constexpr int kPaVKeys = pa_v_keys(D);  // V rows a step of the P V product
  static_assert(kPaVKeys >= 1 && kPaKeys % kPaVKeys == 0, "V step");
  const int seq = blockIdx.y / KV, kvh = blockIdx.y % KV;
  const int qstart = cu_q[seq], qlen = cu_q[seq + 1] - qstart;
  const int clen = ctx_lens[seq];
  const int tpb = kPaRows / G;  // tokens a block
  // Heavier (later) tiles first: the causal triangle makes them the longest.
  const int tq0 = (gridDim.x - 1 - blockIdx.x) * tpb;
  if (tq0 >= qlen) return;  // the whole block: no barrier is skipped by part of it
  const int tq_end = min(qlen, tq0 + tpb);
  const int nkeys = clen + tq_end;  // keys any row of the tile sees
  float* qsm = sm;
  float* ksm = sm + kPaRows * kPaLdQK;
  float* vsm = sm;  // [kPaVKeys, D], over the Q / K steps
  float* S = sm + kPaQKFloats;
  float* rm = S + kPaRows * kPaLdS;
  float* rl = rm + kPaRows;
  float* ra = rl + kPaRows;
  const int tid = threadIdx.x;
  const int rg = tid / kPaColThreads, cg = tid % kPaColThreads;
  const int* table = tables + seq * table_stride;
  if (tid < kPaRows) {
    rm[tid] = -INFINITY;
    rl[tid] = 0.f;
  }
  float o[kPaTR][kPaTC];
#pragma unroll
  for (int i = 0; i < kPaTR; ++i)
#pragma unroll
    for (int c = 0; c < kPaTC; ++c) o[i][c] = 0.f;
  // Loader roles: thread `tid` loads runs of kPaDk of rows tid / (kBlock / (2 kPaRows))...: each of
  // the kPaRows + kPaKeys rows has its run loaded by one thread (kBlock >= 128 = rows + keys).
  static_assert(kBlock >= kPaRows + kPaKeys, "one loader thread a row");

  for (int k0 = 0; k0 < nkeys; k0 += kPaKeys) {
    // 1. S = (q scale) K^T over D in steps of kPaDk.
    float s[kPaTR][kPaTK];
#pragma unroll
    for (int i = 0; i < kPaTR; ++i)
#pragma unroll
      for (int j = 0; j < kPaTK; ++j) s[i][j] = 0.f;
    // This thread's loader row: a query row (tid < kPaRows) or a key row.
    const T* lsrc = nullptr;
    float* ldst = nullptr;
    float lmul = 1.f;
    if (tid < kPaRows) {
      const int tok = tq0 + tid / G;
      if (tok < qlen) {
        lsrc = q + (int64_t)(qstart + tok) * q_tok + (int64_t)(kvh * G + tid % G) * D;
        lmul = scale;
      }
      ldst = qsm + tid * kPaLdQK;
    } else if (tid < kPaRows + kPaKeys) {
      const int kr = tid - kPaRows, j = k0 + kr;
      if (j < clen) {
        lsrc = kc + (((int64_t)table[j / bs] * KV + kvh) * bs + j % bs) * D;
      } else if (j < nkeys) {
        lsrc = knew + (int64_t)(qstart + j - clen) * kv_tok + (int64_t)kvh * D;
      }
      ldst = ksm + kr * kPaLdQK;
    }
    for (int d0 = 0; d0 < D; d0 += kPaDk) {
      if (ldst != nullptr) {
        if (lsrc != nullptr) {
          load_run(lsrc + d0, ldst, lmul);
        } else {
#pragma unroll
          for (int c = 0; c < kPaDk; ++c) ldst[c] = 0.f;
        }
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < kPaDk; c += 4) {
        float4 a[kPaTR], bk[kPaTK];
#pragma unroll
        for (int i = 0; i < kPaTR; ++i)
          a[i] = *reinterpret_cast<const float4*>(qsm + (rg + i * kPaRowGroups) * kPaLdQK + c);
#pragma unroll
        for (int j = 0; j < kPaTK; ++j)
          bk[j] = *reinterpret_cast<const float4*>(ksm + (cg + j * kPaColThreads) * kPaLdQK + c);
#pragma unroll
        for (int i = 0; i < kPaTR; ++i)
#pragma unroll
          for (int j = 0; j < kPaTK; ++j)
            s[i][j] += a[i].x * bk[j].x + a[i].y * bk[j].y + a[i].z * bk[j].z + a[i].w * bk[j].w;
      }
      __syncthreads();
    }
    // 2. Mask (past the context + the row's own token: causal) and store the tile.
#pragma unroll
    for (int i = 0; i < kPaTR; ++i) {
      const int r = rg + i * kPaRowGroups;
      const int tok = tq0 + r / G;
      const int visible = tok < qlen ? clen + tok + 1 : 0;  // keys 0 .. visible - 1
#pragma unroll
      for (int j = 0; j < kPaTK; ++j) {
        const int kk = cg + j * kPaColThreads;
        S[r * kPaLdS + kk] = k0 + kk < visible ? s[i][j] : -INFINITY;
      }
    }
    __syncthreads();
    // 3. Online softmax by rows: kBlock / kPaRows lanes a row.
    {
      constexpr int lpr = kBlock / kPaRows;
      const int r = tid / lpr, l = tid % lpr;
      float mt = -INFINITY;
      for (int kk = l; kk < kPaKeys; kk += lpr) mt = fmaxf(mt, S[r * kPaLdS + kk]);
      mt = group_max(mt, lpr);
      const float m_old = rm[r];
      const float m_new = fmaxf(m_old, mt);
      float ps = 0.f;
      for (int kk = l; kk < kPaKeys; kk += lpr) {
        const float e = exp_sub(S[r * kPaLdS + kk], m_new);
        S[r * kPaLdS + kk] = e;
        ps += e;
      }
      ps = group_sum(ps, lpr);
      __syncthreads();  // every lane has read rm[r] before lane 0 moves it
      if (l == 0) {
        const float alpha = m_old == -INFINITY ? 0.f : expf(m_old - m_new);
        ra[r] = alpha;
        rl[r] = rl[r] * alpha + ps;
        rm[r] = m_new;
      }
    }
    __syncthreads();
    // 4. O = alpha O + P V, V in steps of kPaVKeys rows staged over the Q / K area.
#pragma unroll
    for (int i = 0; i < kPaTR; ++i) {
      const float alpha = ra[rg + i * kPaRowGroups];
#pragma unroll
      for (int c = 0; c < kPaTC; ++c) o[i][c] *= alpha;
    }
    const int kend = min(kPaKeys, nkeys - k0);
    for (int v0 = 0; v0 < kend; v0 += kPaVKeys) {
      constexpr int VN = Vec<T>::N;
      for (int e = tid; e < kPaVKeys * (D / VN); e += kBlock) {
        const int kr = e / (D / VN), c = (e % (D / VN)) * VN;
        const int j = k0 + v0 + kr;
        float* dst = vsm + kr * D + c;
        const T* src = nullptr;
        if (j < clen)
          src = vc + (((int64_t)table[j / bs] * KV + kvh) * bs + j % bs) * D;
        else if (j < nkeys)
          src = vnew + (int64_t)(qstart + j - clen) * kv_tok + (int64_t)kvh * D;
        if (src != nullptr) {
          Vec<T> x;
          x.load(src + c);
#pragma unroll
          for (int t = 0; t < VN; ++t) dst[t] = x.f[t];
        } else {
#pragma unroll
          for (int t = 0; t < VN; ++t) dst[t] = 0.f;
        }
      }
      __syncthreads();
      for (int kr = 0; kr < kPaVKeys; ++kr) {
        float p[kPaTR];
#pragma unroll
        for (int i = 0; i < kPaTR; ++i) p[i] = S[(rg + i * kPaRowGroups) * kPaLdS + v0 + kr];
#pragma unroll
        for (int c = 0; c < kPaTC; ++c) {
          const float vv = vsm[kr * D + cg + c * kPaColThreads];
#pragma unroll
          for (int i = 0; i < kPaTR; ++i) o[i][c] += p[i] * vv;
        }
      }
      __syncthreads();
    }
  }
  // 5. Normalise and store (rows past the chunk's end write nothing).
#pragma unroll
  for (int i = 0; i < kPaTR; ++i) {
    const int r = rg + i * kPaRowGroups;
    const int tok = tq0 + r / G;
    if (tok >= qlen) continue;
    const float l = rl[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* orow = out + (int64_t)(qstart + tok) * o_tok + (int64_t)(kvh * G + r % G) * D;
#pragma unroll
    for (int c = 0; c < kPaTC; ++c) orow[cg + c * kPaColThreads] = static_cast<T>(o[i][c] * inv);
  }
}

// ------------------------------------------------------------------------------------------
// Host wrappers
// ------------------------------------------------------------------------------------------

void check_cache(const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& ref,
                 const char* op) {
  TORCH_CHECK(VO_ON_DEVICE(kc) && kc.dim() == 4 && vc.sizes() == kc.sizes() &&
                  kc.is_contiguous() && vc.is_contiguous(),
              op, ": key / value caches [blocks, kv_heads, block_size, D], contiguous");
  TORCH_CHECK(kc.scalar_type() == ref.scalar_type() && vc.scalar_type() == ref.scalar_type(),
              op, ": the caches must have the query's dtype");
}

// Rows of 16-byte vectors: D a multiple of the vector, row starts 16-byte aligned.
bool rows_aligned(const at::Tensor& t, int64_t row_stride) {
  const int64_t vec = 16 / t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && row_stride % vec == 0;
}

void paged_write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cache(key_cache, value_cache, key, "paged_write_kv");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 &&
                  value.stride(2) == 1 && value.scalar_type() == key.scalar_type(),
              "paged_write_kv: key, value [T, kv_heads, D] with contiguous rows");
  const int64_t T = key.size(0);
  const int KV = key_cache.size(1), bs = key_cache.size(2), D = key_cache.size(3);
  TORCH_CHECK(key.size(1) == KV && key.size(2) == D, "paged_write_kv: cache shape mismatch");
  TORCH_CHECK(slot_mapping.numel() >= T && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kLong ||
                   slot_mapping.scalar_type() == at::kInt),
              "paged_write_kv: int32 / int64 slot_mapping with a slot per token");
  if (T == 0) return;
  VO_DEVICE_GUARD(key);
  const int64_t n = T * KV * D;
  const int grid = static_cast<int>(std::min<int64_t>((n + kBlock - 1) / kBlock, 4096));
  VO_DISPATCH_FLOATS(key.scalar_type(), "paged_write_kv", [&] {
    using T_ = scalar_t;
    if (slot_mapping.scalar_type() == at::kLong) {
      auto kernel = pa_write_kv_kernel<T_, int64_t>;
      VO_LAUNCH(kernel, grid, kBlock, 0, key.data_ptr<T_>(),
                value.data_ptr<T_>(), key.stride(0), key.stride(1), value.stride(0),
                value.stride(1), key_cache.data_ptr<T_>(), value_cache.data_ptr<T_>(),
                slot_mapping.data_ptr<int64_t>(), T, KV, D, bs);
    } else {
      auto kernel = pa_write_kv_kernel<T_, int32_t>;
      VO_LAUNCH(kernel, grid, kBlock, 0, key.data_ptr<T_>(),
                value.data_ptr<T_>(), key.stride(0), key.stride(1), value.stride(0),
                value.stride(1), key_cache.data_ptr<T_>(), value_cache.data_ptr<T_>(),
                slot_mapping.data_ptr<int32_t>(), T, KV, D, bs);
    }
  });
}

// Tokens a decode partition: about one block an SM at this batch, between 256 and 512 tokens
// (the score tile's shared memory), more only past 4096 partitions. A block's fixed costs (q,
// the reductions, its partial) want long partitions: on an H100 at B = 1 (worklogs/LEDGER.md,
// issue 48) 32K took 82 / 53 / 49 / 71 us with partitions of 64 / 128 / 256 / 512 tokens and
// 256K 882 / 520 / 344 / 251 us.
int64_t decode_partition(int64_t max_len, int64_t blocks_per_part, int64_t sms) {
  const int64_t want = std::max<int64_t>(1, (sms + blocks_per_part - 1) / blocks_per_part);
  int64_t part = (max_len + want - 1) / want;
  part = (part + 63) / 64 * 64;
  part = std::min<int64_t>(512, std::max<int64_t>(256, part));
  const int64_t least = (max_len + 4095) / 4096;
  return std::max(part, (least + 63) / 64 * 64);
}

// Shared memory the kernels ask for, the reason a call cannot run, or "" (the Python side asks
// first, so a refused shape takes the PyTorch path without an exception).
int64_t smem_limit(const at::Tensor& t) { return VO_SMEM_OPTIN(t); }

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                        int64_t partition) {
  check_cache(key_cache, value_cache, query, "paged_decode");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "paged_decode: query [B, H, D] with contiguous heads");
  const int B = query.size(0), H = query.size(1), D = query.size(2);
  const int KV = key_cache.size(1), bs = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && H % KV == 0,
              "paged_decode: H a multiple of kv_heads");
  const int G = H / KV;
  TORCH_CHECK(G == 1 || G == 2 || G == 4 || G == 8,
              "paged_decode: 1, 2, 4 or 8 query heads a kv head");
  const int64_t vec = 16 / query.element_size();
  TORCH_CHECK(D % vec == 0 && kBlock % (D / vec) == 0 && D / vec <= kBlock,
              "paged_decode: D a multiple of ", vec, " whose vectors divide the block");
  TORCH_CHECK(rows_aligned(query, query.stride(0)) && rows_aligned(key_cache, D) &&
                  rows_aligned(value_cache, D),
              "paged_decode: 16-byte aligned rows");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) >= B,
              "paged_decode: int32 block_tables [B, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.numel() >= B,
              "paged_decode: int32 seq_lens [B]");
  auto out = at::empty_like(query);
  if (B == 0) return out;
  VO_DEVICE_GUARD(query);
  const int64_t max_len = std::max<int64_t>(1, max_seq_len);
  const int64_t part =
      partition > 0 ? partition : decode_partition(max_len, (int64_t)B * KV, VO_SM_COUNT(query));
  const int64_t P = (max_len + part - 1) / part;
  const int64_t smem = decode_smem_floats(G, D, part) * sizeof(float);
  const int64_t smem_c = (P + kMaxWarps) * sizeof(float);
  TORCH_CHECK(smem <= smem_limit(query) && smem_c <= smem_limit(query),
              "paged_decode: ", std::max(smem, smem_c), " bytes of shared memory a block, the "
              "device allows ", smem_limit(query));
  TORCH_CHECK(P <= 65535, "paged_decode: too many partitions");
  // The partials in one allocation: m [B, H, P] | l [B, H, P] | P V [B, H, P, D].
  at::Tensor partials;
  if (P > 1) partials = at::empty({(int64_t)B * H * P * (D + 2)}, query.options().dtype(at::kFloat));
  VO_DISPATCH_FLOATS(query.scalar_type(), "paged_decode", [&] {
    using T_ = scalar_t;
    float* pmp = P > 1 ? partials.data_ptr<float>() : nullptr;
    float* plp = P > 1 ? pmp + (int64_t)B * H * P : nullptr;
    float* pap = P > 1 ? plp + (int64_t)B * H * P : nullptr;
    auto launch = [&](auto kernel) {
      VO_SMEM_OPT_IN(kernel, smem);
      VO_LAUNCH(kernel, dim3(P, KV, B), kBlock, smem, query.data_ptr<T_>(), query.stride(0),
                key_cache.data_ptr<T_>(), value_cache.data_ptr<T_>(),
                block_tables.data_ptr<int>(), block_tables.stride(0), seq_lens.data_ptr<int>(),
                static_cast<float>(scale), KV, D, bs, static_cast<int>(part),
                static_cast<int>(P), out.data_ptr<T_>(), pmp, plp, pap);
    };
    if (G == 1) launch(pa_decode_kernel<T_, 1>);
    else if (G == 2) launch(pa_decode_kernel<T_, 2>);
    else if (G == 4) launch(pa_decode_kernel<T_, 4>);
    else launch(pa_decode_kernel<T_, 8>);
    if (P > 1) {
      VO_SMEM_OPT_IN(pa_decode_combine_kernel<T_>, smem_c);
      VO_LAUNCH(pa_decode_combine_kernel<T_>, dim3(H, B), kBlock, smem_c, pmp, plp, pap,
                seq_lens.data_ptr<int>(), D, static_cast<int>(part), static_cast<int>(P),
                out.data_ptr<T_>());
    }
  });
  return out;
}

at::Tensor paged_prefill(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const c10::optional<at::Tensor>& key_cache,
                         const c10::optional<at::Tensor>& value_cache,
                         const c10::optional<at::Tensor>& block_tables, const at::Tensor& cu_q,
                         const at::Tensor& ctx_lens, int64_t max_query_len, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes(),
              "paged_prefill: query [T, H, D], key / value [T, kv_heads, D]");
  const int64_t T = query.size(0);
  const int H = query.size(1), D = query.size(2), KV = key.size(1);
  TORCH_CHECK(VO_ON_DEVICE(query) && key.size(0) == T && key.size(2) == D && H % KV == 0,
              "paged_prefill: shapes");
  const int G = H / KV;
  TORCH_CHECK(kPaRows % G == 0, "paged_prefill: query heads per kv head must divide ", kPaRows);
  TORCH_CHECK(D == 64 || D == 128 || D == 256, "paged_prefill: D must be 64, 128 or 256");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "paged_prefill: one dtype");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == D && key.stride(2) == 1 &&
                  key.stride(1) == D && value.strides() == key.strides(),
              "paged_prefill: contiguous heads; key and value with the same strides");
  TORCH_CHECK(rows_aligned(query, query.stride(0)) && rows_aligned(key, key.stride(0)) &&
                  rows_aligned(value, value.stride(0)),
              "paged_prefill: 16-byte aligned rows");
  const bool has_cache = key_cache.has_value() && value_cache.has_value();
  if (has_cache) {
    check_cache(*key_cache, *value_cache, query, "paged_prefill");
    TORCH_CHECK(key_cache->size(1) == KV && key_cache->size(3) == D,
                "paged_prefill: cache shape mismatch");
    TORCH_CHECK(block_tables.has_value() && block_tables->scalar_type() == at::kInt &&
                    block_tables->dim() == 2 && block_tables->stride(1) == 1,
                "paged_prefill: int32 block_tables [N, max_blocks]");
  }
  TORCH_CHECK(cu_q.scalar_type() == at::kInt && ctx_lens.scalar_type() == at::kInt &&
                  cu_q.is_contiguous() && ctx_lens.is_contiguous() && cu_q.numel() >= 1,
              "paged_prefill: int32 cu_q [N + 1], ctx_lens [N]");
  const int N = cu_q.numel() - 1;
  TORCH_CHECK(ctx_lens.numel() >= N, "paged_prefill: a context length per sequence");
  auto out = at::empty_like(query);
  if (T == 0 || N == 0 || max_query_len <= 0) return out;
  VO_DEVICE_GUARD(query);
  const int64_t smem = kPaPrefillSmemFloats * sizeof(float);
  TORCH_CHECK(smem <= smem_limit(query), "paged_prefill: ", smem,
              " bytes of shared memory a block, the device allows ", smem_limit(query));
  const int tpb = kPaRows / G;
  const int64_t tiles = (max_query_len + tpb - 1) / tpb;
  TORCH_CHECK(tiles <= 2147483647LL && (int64_t)N * KV <= 65535, "paged_prefill: grid");
  VO_DISPATCH_FLOATS(query.scalar_type(), "paged_prefill", [&] {
    using T_ = scalar_t;
    const T_* kcp = has_cache ? key_cache->data_ptr<T_>() : nullptr;
    const T_* vcp = has_cache ? value_cache->data_ptr<T_>() : nullptr;
    const int* tp = has_cache ? block_tables->data_ptr<int>() : nullptr;
    const int64_t ts = has_cache ? block_tables->stride(0) : 0;
    const int bs = has_cache ? key_cache->size(2) : 1;
    auto launch = [&](auto kernel) {
      VO_SMEM_OPT_IN(kernel, smem);
      VO_LAUNCH(kernel, dim3(tiles, N * KV), kBlock, smem, query.data_ptr<T_>(),
                query.stride(0), key.data_ptr<T_>(), value.data_ptr<T_>(), key.stride(0), kcp,
                vcp, tp, ts, cu_q.data_ptr<int>(), ctx_lens.data_ptr<int>(), KV, G, bs,
                static_cast<float>(scale), out.data_ptr<T_>(), out.stride(0));
    };
    if (D == 256) launch(pa_prefill_kernel<T_, 256>);
    else if (D == 128) launch(pa_prefill_kernel<T_, 128>);
    else launch(pa_prefill_kernel<T_, 64>);
  });
  return out;
}

// What decode (at a longest context of max_len tokens, batch x kv heads blocks a partition)
// and prefill ask of a block on t's device, in words (kernels.py / kernel_resources.py).
std::string paged_attention_plan(const at::Tensor& t, int64_t G, int64_t D, int64_t max_len,
                                 int64_t batch_kv) {
  const int64_t part = decode_partition(std::max<int64_t>(1, max_len), batch_kv, VO_SM_COUNT(t));
  const int64_t P = (std::max<int64_t>(1, max_len) + part - 1) / part;
  const int64_t dec = decode_smem_floats(G, D, part) * sizeof(float);
  const int64_t comb = (P + kMaxWarps) * sizeof(float);
  return "decode: " + std::to_string(P) + " partitions of " + std::to_string(part) +
         " tokens, " + std::to_string(dec) + " bytes a block" +
         (P > 1 ? " + combine " + std::to_string(comb) + " bytes (2 launches)" : " (1 launch)") +
         "; prefill: " + std::to_string(kPaPrefillSmemFloats * sizeof(float)) +
         " bytes a block (1 launch); device allows " + std::to_string(smem_limit(t));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vo_kernels, m) {
  m.def("paged_attention_plan(Tensor t, int G, int D, int max_len, int batch_kv) -> str");
  m.def("paged_write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache,"
        " Tensor slot_mapping) -> ()");
  m.def("paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables,"
        " Tensor seq_lens, float scale, int max_seq_len, int partition) -> Tensor");
  m.def("paged_prefill(Tensor query, Tensor key, Tensor value, Tensor? key_cache,"
        " Tensor? value_cache, Tensor? block_tables, Tensor cu_q, Tensor ctx_lens,"
        " int max_query_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(vo_kernels, VO_DISPATCH_KEY, m) {
  m.impl("paged_write_kv", &paged_write_kv);
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
  m.impl("paged_attention_plan", &paged_attention_plan);
}
