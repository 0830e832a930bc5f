// The routed experts' grouped GEMMs of MoE prefill on tensor cores
// (vllm_overrides.native.kernels.moe_prefill, method "wmma").
//
// Rows sit in expert order (moe_order: expert e owns rows [ends[e-1], ends[e])); each expert's
// weight is w[e] [N, K] (vLLM's layouts, K contiguous). One block computes a 128-row tile of one
// expert's group against 128 weight rows, so no host sync and no grouped-GEMM library is needed:
//   gate/up (kGather, kAct): the tile's A rows are x's token rows src[q] read in place (no copy
//     of x into expert order), its weight rows are 64 gate rows n0 + j and the 64 matching up
//     rows I + n0 + j, and the epilogue writes silu(gate) * up * ws[q], rounded once: [P, I];
//   down: A is that [P, I] product, the weight rows n0 .. n0 + 127, out [P, N].
// Products are nvcuda::wmma 16x16x16 tiles in the input's 16-bit type with float accumulation.
// K advances 32 at a time through two shared-memory stages: the next step's 16-byte vectors
// load into registers while the current step's products run, one barrier a step.
// A block walks `run` consecutive column blocks of its tile as one pipeline (the next column
// block's first vectors load during this one's epilogue): down has K = I (128 on a TP4 rank),
// so a block of one column block spent most of its life on the first load and the epilogue.
// Down (K <= 128) keeps the tile's A rows in shared memory for the whole walk; its stages then
// carry weight rows only.
//
// The block has kWarps warps of whatever width the device has (8 x warpSize threads: 256 on
// NVIDIA, 512 with 64-lane warps; the kernel takes the width as a template constant, WS, that
// the host reads from the device); warp w computes rows 32 (w % 4) .. + 31 against weight
// rows 32 (w / 4) .. + 31 of each 64-row half, 2 x 4 accumulator tiles. The grid's x is
// (tile, run of column blocks) pairs with the run fastest, so the blocks sharing an A tile
// and those sharing an expert's weights run together; tiles past the last expert's return.
#include "common.cuh"

namespace {

constexpr int kWarps = 8;
constexpr int kTM = kGroupedTileRows;  // 128 rows a tile
constexpr int kTN = 128;               // weight rows a tile (two halves of 64)
constexpr int kTK = 32;                // K a step
constexpr int kLdS = kTK + 8;          // stage row pitch: 80 bytes, rows shift banks by 16
constexpr int kResMaxK = 128;          // down's A tile stays in shared memory up to this K
// The epilogue's scratch, floats a warp: two 16x16 tiles (gate and up) in a stage of A and B;
// down with A resident has its own, one tile laid out as frag_out8's (common.cuh: rows kScrLd
// = 24 floats apart, so that the accumulator's 8-byte stores hit distinct banks in each
// half-warp). Down reads it back inline rather than through frag_out8: that call, with the
// same reads, made both GEMMs 3-4 % slower in bf16 on the H200 (the compiler schedules the
// kernel differently; worklogs/results/review-refactors-h200-2026-12-04).
constexpr int kScrWarpStage = 2 * 256;  // floats a warp in a stage: the gate and up tiles
static_assert(kTM == 128 && kTN * kTK / 8 % (kWarps * 32) == 0, "tile shape");
static_assert(kWarps * kScrWarpStage * sizeof(float) <= (kTM + kTN) * kLdS * sizeof(uint16_t),
              "the epilogue's scratch fits in one stage of A and B");

// A stage holds kTK columns of the tile's A rows (unless A is resident) and of its B rows.
template <bool kResA>
struct Stage {
  static constexpr int kARows = kResA ? 0 : kTM;
  static constexpr int kElems = (kARows + kTN) * kLdS;
  static constexpr int kVecs = (kARows + kTN) * kTK / 8;   // 16-byte vectors: A rows, then B
};

// Shared memory of a launch, in bytes: two stages, and with A resident its [kTM, K + 8] tile and
// the epilogue's scratch (a B-only stage is too small for it).
// kOne: one stage instead of two (20 KB: a device granting less than 40 KB a block, the card's
// 32 KB), two barriers a step instead of one and no load hidden behind the step's products.
size_t smem_bytes(bool res_a, int64_t K, bool one = false) {
  if (!res_a) return (one ? 1 : 2) * Stage<false>::kElems * sizeof(uint16_t);
  return (2 * Stage<true>::kElems + kTM * (K + 8)) * sizeof(uint16_t) +
         kWarps * kScrWarp * sizeof(float);
}

template <typename M>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, M, wmma::row_major>;
template <typename M>
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, M, wmma::col_major>;

// kWalk: the block may walk several column blocks (run > 1). Its own instantiation, because
// the walk keeps the next loads and their pointers live through the epilogue: with one loop
// for both, gate/up at run 1 ran 41 % slower on an H200 (LEDGER, same section).
// kResA (down, K <= kResMaxK): the tile's A rows are loaded once, whole K, and stay in shared
// memory while the block walks its column blocks; the stages then carry B alone, so each
// column block re-reads only its weights (A was re-read once per column block).
// WS: the device's warp width (32 or 64, read by the host), so the thread count, each thread's
// share of a stage and which of its vectors are A or B rows are constants.
// kOne (not with kResA): a single stage, see smem_bytes.
template <typename T, bool kGather, bool kAct, bool kWalk, bool kResA, int WS, bool kOne = false>
__global__ void
#ifndef VO_CPU_EMULATION
__launch_bounds__(kWarps * 64)  // 64-lane warps at most: <= 128 registers on NVIDIA's 256
#endif
moe_grouped_gemm_kernel(const T* __restrict__ a, int64_t s_a, const int* __restrict__ src,
                        const T* __restrict__ w, int N, int K, const int* __restrict__ ends,
                        const int* __restrict__ tile_starts, int E, const float* __restrict__ ws,
                        int col_blocks, int run, T* __restrict__ out, int64_t s_out) {
  if constexpr (!mma_arch_ok<T>()) {
    __trap();
  } else {
    using M = typename Mma<T>::type;
    using S = Stage<kResA>;
    static_assert(!(kOne && kResA), "one stage: streamed A only");
    constexpr int kMask = kOne ? 0 : 1;  // stage of step t: t & kMask
    constexpr int nthreads = kWarps * WS;
    constexpr int kStageElems = S::kElems, kARows = S::kARows;
    constexpr int kPer = (S::kVecs + nthreads - 1) / nthreads;
    VO_MMA_SMEM(smb);
    M* stage = reinterpret_cast<M*>(smb);  // [2][kARows + kTN][kLdS]
    // With kResA: then A [kTM][K + 8] (rows shift banks by 16 bytes), then the scratch.
    M* res = stage + 2 * kStageElems;
    const int lda = K + 8;
    float* scratch = reinterpret_cast<float*>(res + (kResA ? kTM * lda : 0));
    const int tid = threadIdx.x;
    const int warp = tid / WS, lane = tid % WS;
    const int runs = (col_blocks + run - 1) / run;
    const int tile = blockIdx.x / runs, cb0 = (blockIdx.x % runs) * run;
    if (tile >= tile_starts[E]) return;
    const int e = owner_of(tile_starts, E, tile);
    const int g0 = e > 0 ? ends[e - 1] : 0, g1 = ends[e];
    const int r0 = g0 + (tile - tile_starts[e]) * kTM;
    const int rows = g1 - r0 < kTM ? g1 - r0 : kTM;
    // Weight rows of the two halves: gate n0 + j and up I + n0 + j, or n0 + j and n0 + 64 + j;
    // the next column block's are cn rows further.
    constexpr int cn = kAct ? kTN / 2 : kTN;
    const int n0 = cb0 * cn, half2 = kAct ? N / 2 : kTN / 2;
    const T* we = w + static_cast<int64_t>(e) * N * K;
    const int nk = K / kTK;  // steps of one column block
    const int ncb = kWalk ? (col_blocks - cb0 < run ? col_blocks - cb0 : run) : 1;

    if constexpr (kResA) {  // the whole A tile, once; rows past the group are zeros
      const int kv = K / 8;
      for (int v = tid; v < kTM * kv; v += nthreads) {
        const int r = v / kv, c = (v % kv) * 8;
        *reinterpret_cast<uint4*>(res + r * lda + c) =
            r < rows ? *reinterpret_cast<const uint4*>(a + static_cast<int64_t>(r0 + r) * s_a + c)
                     : uint4{0u, 0u, 0u, 0u};
      }
    }

    // This thread's vectors of a stage: source pointers fixed for the whole K walk.
    const T* vp[kPer];
    int vdst[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int v = tid + i * nthreads;
      vp[i] = nullptr;
      vdst[i] = -1;
      if (v < S::kVecs) {
        // Eight consecutive vectors cover rows r and r + 4, four each: with rows 80 bytes apart
        // a quarter-warp's 16-byte stores then fall on distinct banks (rows r, r + 1 share one).
        static_assert(kTK / 8 == 4 && (kTM + kTN) % 8 == 0, "four vectors a row");
        const int g = v / 8, l = v % 8;
        const int r = g / 4 * 8 + g % 4 + l / 4 * 4, c = l % 4 * 8;
        vdst[i] = r * kLdS + c;
        if (r < kARows) {
          if (r < rows) {
            const int q = r0 + r;
            vp[i] = a + (kGather ? static_cast<int64_t>(src[q]) : q) * s_a + c;
          }
        } else {
          const int j = r - kARows;
          const int n = j < kTN / 2 ? n0 + j : half2 + n0 + j - kTN / 2;
          vp[i] = we + static_cast<int64_t>(n) * K + c;
        }
      }
    }
    uint4 reg[kPer];
    auto fetch = [&](int c, int k0) {  // column block cb0 + c, K from k0
      const int64_t b0 = k0 + static_cast<int64_t>(c) * cn * K;
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        reg[i] = vp[i] != nullptr
                     ? *reinterpret_cast<const uint4*>(vp[i] + (vdst[i] < kARows * kLdS ? k0 : b0))
                     : uint4{0u, 0u, 0u, 0u};
    };
    auto put = [&](int s) {
      M* st = stage + s * kStageElems;
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (vdst[i] >= 0) *reinterpret_cast<uint4*>(st + vdst[i]) = reg[i];
    };

    // Warp tiles: rows 32 wm .. + 31, weight rows 32 wn .. + 31 of each half (kWarps = 8).
    FragC acc[2][4];
    const int wm = warp % 4, wn = warp / 4;

    // Epilogue of column block cb through two 16x16 float tiles per warp in scr (a stage no
    // warp reads any more; with kResA one tile of its own), in runs of 8 columns: one 16-byte
    // store each (32 runs a tile; lanes past 32 sit out).
    constexpr int ldc = kResA ? kScrLd : 16;  // scratch row pitch, floats
    auto emit = [&](int cb, float* scr) {
      const int nb = cb * cn;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int rt = wm * 32 + i * 16;  // tile row of the fragment's first row
#pragma unroll
        for (int j = 0; j < (kAct ? 2 : 4); ++j) {
          wmma::store_matrix_sync(scr, acc[i][j], ldc, wmma::mem_row_major);
          if (kAct) wmma::store_matrix_sync(scr + 256, acc[i][j + 2], 16, wmma::mem_row_major);
          __syncwarp();
          for (int u = lane; u < 32; u += WS) {
            const int r = u / 2, c8 = (u % 2) * 8;
            if (rt + r < rows) {
              const int q = r0 + rt + r;
              float f[8];
              if (kAct) {
                const float wq = ws[q];
#pragma unroll
                for (int t = 0; t < 8; ++t)
                  f[t] = silu_f(scr[r * 16 + c8 + t]) * scr[256 + r * 16 + c8 + t] * wq;
              } else {
                // Two 16-byte reads, odd lanes taking their second half first: with rows 24
                // floats apart each quarter-warp's reads then fall on distinct banks.
                const int h = (u % 2) * 4;
                const float* row = scr + r * ldc + c8;
                const float4 v0 = *reinterpret_cast<const float4*>(row + h);
                const float4 v1 = *reinterpret_cast<const float4*>(row + 4 - h);
                const float4 lo = h ? v1 : v0, hi = h ? v0 : v1;
                f[0] = lo.x, f[1] = lo.y, f[2] = lo.z, f[3] = lo.w;
                f[4] = hi.x, f[5] = hi.y, f[6] = hi.z, f[7] = hi.w;
              }
              const int col = kAct ? nb + wn * 32 + j * 16 + c8
                                   : nb + (j < 2 ? 0 : kTN / 2) + wn * 32 + (j % 2) * 16 + c8;
              store_vec(out + static_cast<int64_t>(q) * s_out + col, f);
            }
          }
          __syncwarp();
        }
      }
    };

    fetch(0, 0);
    put(0);
    __syncthreads();
    int t = 0;  // steps done; step t computes from stage t & 1
    for (int c = 0; c < ncb; ++c) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[i][j], 0.f);
      for (int k = 0; k < nk; ++k, ++t) {
        // The next step's vectors, in flight through this step (and, across column blocks,
        // through the epilogue).
        if (k + 1 < nk) fetch(c, (k + 1) * kTK);
        else if (c + 1 < ncb) fetch(c + 1, 0);
        const M* st = stage + (t & kMask) * kStageElems;
#pragma unroll
        for (int kk = 0; kk < kTK; kk += 16) {
          FragA<M> fa[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int ar = wm * 32 + i * 16;
            if constexpr (kResA)
              wmma::load_matrix_sync(fa[i], res + ar * lda + k * kTK + kk, lda);
            else
              wmma::load_matrix_sync(fa[i], st + ar * kLdS + kk, kLdS);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {  // one B fragment live at a time (registers)
            FragBt<M> fb;
            const int br = (j < 2 ? 0 : kTN / 2) + wn * 32 + (j % 2) * 16;
            wmma::load_matrix_sync(fb, st + (kARows + br) * kLdS + kk, kLdS);
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[i][j], fa[i], fb, acc[i][j]);
          }
        }
        if (k + 1 < nk) {
          if (kOne) __syncthreads();  // every warp is done with the only stage
          put((t + 1) & kMask);
          __syncthreads();
        }
      }
      if constexpr (kResA) {
        // The scratch is its own; the stage put() fills was last read two steps ago, before
        // the previous step's barrier.
        emit(cb0 + c, scratch + warp * kScrWarp);
      } else {
        __syncthreads();  // every warp is past the last stage: it becomes the scratch
        emit(cb0 + c, reinterpret_cast<float*>(stage + ((t - 1) & kMask) * kStageElems) +
                          warp * kScrWarpStage);
      }
      if (kOne && c + 1 < ncb) __syncthreads();  // the scratch (the only stage) is read
      if (c + 1 < ncb) put(t & kMask);
      __syncthreads();
    }
  }
}

// Column blocks a block walks unless told. Only where one column block is a short K walk
// (<= kWalkMaxSteps steps: down, K = I): what the walk gains is the first load and the epilogue
// hidden behind the next block's loads, which pays on down's 4 steps and lost on gate/up's 64
// (H200 figures: worklogs/LEDGER.md, "MoE down GEMM walks column blocks"). Then as many as
// keep the grid at >= kMinBlocksPerSm blocks an SM (several waves of the two resident).
constexpr int kWalkMaxSteps = 8;
constexpr int64_t kMinBlocksPerSm = 16;
int64_t default_run(int64_t col_blocks, int64_t row_tiles, int64_t k_steps, int64_t sms) {
  if (k_steps > kWalkMaxSteps) return 1;
  int64_t run = col_blocks;
  while (run > 1 && row_tiles * ((col_blocks + run - 1) / run) < kMinBlocksPerSm * sms)
    run = (run + 1) / 2;
  return run;
}

// The variant a call runs on a's device: down keeps its A tile resident where the device
// grants 66 KB a block; otherwise two streamed stages (40 KB), or one (20 KB) on a device
// granting less (the card's 32 KB).
struct GemmPlan {
  bool res_a, one;
  size_t smem;
  int64_t limit;
  GemmPlan(const at::Tensor& a, int64_t K, bool gather) {
    limit = VO_SMEM_OPTIN(a);
    res_a = !gather && K <= kResMaxK && static_cast<int64_t>(smem_bytes(true, K)) <= limit;
    one = !res_a && static_cast<int64_t>(smem_bytes(false, K)) > limit;
    smem = smem_bytes(res_a, K, one);
  }
  std::string describe() const {
    return std::string(res_a ? "A tile resident" : one ? "one streamed stage" : "two streamed stages") +
           ", " + std::to_string(smem) + " bytes of shared memory a block (device allows " +
           std::to_string(limit) + ")";
  }
};

std::string moe_grouped_gemm_plan(const at::Tensor& a, int64_t K, bool gather) {
  if (!wmma_enabled()) return "off (VO_KERNELS_WMMA=0)";
  return GemmPlan(a, K, gather).describe();
}

// gate/up (src given): out [P, N / 2] = silu(x[src] w[e][:N/2]^T) * (x[src] w[e][N/2:]^T) * ws;
// down (no src): out [P, N] = a w[e]^T, P = a's rows. ends / tile_starts from moe_order.
// run: column blocks (128 of N's rows; gate/up: 64 of I's columns) a block walks; 0 = pick.
at::Tensor moe_grouped_gemm(const at::Tensor& a, const c10::optional<at::Tensor>& src,
                            const at::Tensor& w, const at::Tensor& ends,
                            const at::Tensor& tile_starts, const c10::optional<at::Tensor>& ws,
                            int64_t run) {
  const bool gather = src.has_value();
  TORCH_CHECK(VO_ON_DEVICE(a) && a.dim() == 2 && a.stride(1) == 1 && w.dim() == 3 &&
                  w.is_contiguous() && w.scalar_type() == a.scalar_type() &&
                  (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
              "moe_grouped_gemm: a [rows, K] and w [E, N, K] contiguous, both fp16 or bf16");
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(a.size(1) == K && K % kTK == 0 && (a.stride(0) * a.element_size()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
              "moe_grouped_gemm: K a multiple of 32, rows of a 16-byte aligned");
  TORCH_CHECK(N % kTN == 0,
              "moe_grouped_gemm: N a multiple of 128 (gate/up: I a multiple of 64)");
  TORCH_CHECK(ends.scalar_type() == at::kInt && ends.numel() == E &&
                  tile_starts.scalar_type() == at::kInt && tile_starts.numel() == E + 1 &&
                  ends.is_contiguous() && tile_starts.is_contiguous(),
              "moe_grouped_gemm: ends [E], tile_starts [E + 1] int32 (moe_order)");
  TORCH_CHECK(gather == ws.has_value(), "moe_grouped_gemm: src and ws come together (gate/up)");
  int64_t P = a.size(0);
  if (gather) {
    TORCH_CHECK(src->scalar_type() == at::kInt && src->dim() == 1 && src->is_contiguous() &&
                    ws->scalar_type() == at::kFloat && ws->is_contiguous() &&
                    ws->numel() == src->numel(),
                "moe_grouped_gemm: src [P] int32, ws [P] float32");
    P = src->numel();
  }
#ifndef VO_CPU_EMULATION
  if (a.scalar_type() == at::kBFloat16) {  // bf16 fragments need sm_80 (the caller checks too)
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                          a.device().index()));
    TORCH_CHECK(major >= 8, "moe_grouped_gemm: bf16 needs compute capability 8.0");
  }
#endif
  VO_DEVICE_GUARD(a);
  const int64_t cols = gather ? N / 2 : N;
  auto out = at::empty({P, cols}, a.options());
  if (P == 0) return out;
  TORCH_CHECK(run >= 0, "moe_grouped_gemm: run >= 0");
  const int64_t col_blocks = N / kTN;  // gate/up: 64 of I's columns a block
  const int64_t tiles = (P + kTM - 1) / kTM + E;  // each expert's last tile may be partial
  if (run == 0) run = default_run(col_blocks, (P + kTM - 1) / kTM, K / kTK, VO_SM_COUNT(a));
  run = std::min(run, col_blocks);
  const int64_t runs = (col_blocks + run - 1) / run;
  TORCH_CHECK(tiles * runs < (int64_t{1} << 31), "moe_grouped_gemm: grid too large");
  // A device that grants a block less than the resident tile needs keeps down on the streamed
  // path (40 KB) instead of losing the kernel to the per-expert loop.
  const GemmPlan plan(a, K, gather);
  TORCH_CHECK(static_cast<int64_t>(plan.smem) <= plan.limit, "moe_grouped_gemm: ", plan.smem,
              " bytes of shared memory a block, the device allows ", plan.limit);
  TORCH_CHECK(wmma_enabled(), "moe_grouped_gemm: wmma switched off (VO_KERNELS_WMMA=0)");
  const bool res_a = plan.res_a, one = plan.one;
  const size_t smem = plan.smem;
  auto launch = [&](auto* tag, auto width) {
    using S = std::remove_pointer_t<decltype(tag)>;
    constexpr int W = decltype(width)::value;
    constexpr int threads = kWarps * W;
    auto* kernel =
        gather ? (one ? (run > 1 ? &moe_grouped_gemm_kernel<S, true, true, true, false, W, true>
                                 : &moe_grouped_gemm_kernel<S, true, true, false, false, W, true>)
                      : (run > 1 ? &moe_grouped_gemm_kernel<S, true, true, true, false, W>
                                 : &moe_grouped_gemm_kernel<S, true, true, false, false, W>))
        : res_a ? (run > 1 ? &moe_grouped_gemm_kernel<S, false, false, true, true, W>
                           : &moe_grouped_gemm_kernel<S, false, false, false, true, W>)
        : one   ? (run > 1 ? &moe_grouped_gemm_kernel<S, false, false, true, false, W, true>
                           : &moe_grouped_gemm_kernel<S, false, false, false, false, W, true>)
                : (run > 1 ? &moe_grouped_gemm_kernel<S, false, false, true, false, W>
                           : &moe_grouped_gemm_kernel<S, false, false, false, false, W>);
    VO_SMEM_OPT_IN(kernel, smem);
    VO_LAUNCH(kernel, static_cast<unsigned>(tiles * runs), threads, smem,
        a.data_ptr<S>(), a.stride(0), gather ? src->data_ptr<int>() : nullptr, w.data_ptr<S>(),
        static_cast<int>(N), static_cast<int>(K), ends.data_ptr<int>(), tile_starts.data_ptr<int>(),
        static_cast<int>(E), gather ? ws->data_ptr<float>() : nullptr,
        static_cast<int>(col_blocks), static_cast<int>(run), out.data_ptr<S>(), out.stride(0));
  };
  auto by_width = [&](auto* tag) {
    with_warp_width(a, "moe_grouped_gemm", [&](auto width) { launch(tag, width); });
  };
  AT_DISPATCH_SWITCH(a.scalar_type(), "moe_grouped_gemm",
      AT_DISPATCH_CASE(at::ScalarType::Half, [&] { by_width(static_cast<scalar_t*>(nullptr)); })
      AT_DISPATCH_CASE(at::ScalarType::BFloat16, [&] { by_width(static_cast<scalar_t*>(nullptr)); }));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vo_kernels, m) {
  m.def("moe_grouped_gemm_plan(Tensor a, int K, bool gather) -> str");
  m.def("moe_grouped_gemm(Tensor a, Tensor? src, Tensor w, Tensor ends, Tensor tile_starts,"
        " Tensor? ws, int run=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(vo_kernels, VO_DISPATCH_KEY, m) {
  m.impl("moe_grouped_gemm", &moe_grouped_gemm);
  m.impl("moe_grouped_gemm_plan", &moe_grouped_gemm_plan);
}
