// Shared by every kernel source of vo_native_kernels (native_kernels.cu: decode; moe_prefill.cu,
// moe_grouped_gemm.cu, gdn_conv.cu, gdn_chunk.cu: prefill): the platform switch (CUDA or the
// host-thread test build), dtype dispatch, block sizes, the reductions and the wmma types.
//
// Portability rules (the target is a CUDA-compatible, Triton-less card with 64-lane warps):
// plain CUDA C++ only -- no Triton, no CUTLASS/CuTe, no inline PTX; no warp size is assumed
// (reductions loop over `warpSize`, sub-group shuffles use widths <= 16 that divide any warp,
// and the shuffle mask is `__activemask()`, whose type is the platform's own; every block size
// is a multiple of 64); float32 accumulation, no float64 anywhere on the device.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cstdlib>
#include <string>

// A positive integer from the environment (read at each call: a getenv, and tests may change
// it); unset or not positive: no cap.
inline int64_t vo_env_limit(const char* name) {
  const char* v = std::getenv(name);
  const long long n = v != nullptr ? std::atoll(v) : 0;
  return n > 0 ? static_cast<int64_t>(n) : INT64_MAX;
}

// Whether kernels may use nvcuda::wmma's 16x16x16 fragments (VO_KERNELS_WMMA=0: no). A device
// whose fragments differ (the target card reports M16 x N32 x K32) runs the kernels' FMA
// variants or the PyTorch path instead.
inline bool wmma_enabled() {
  const char* v = std::getenv("VO_KERNELS_WMMA");
  return v == nullptr || std::string(v) != "0";
}

#ifdef VO_CPU_EMULATION
// Test build only: the CUDA execution model on host threads (cpu_emulation.h), so CPU CI runs
// these very kernels, with 64- and 32-lane warps.
#include "cpu_emulation.h"
#else
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#define VO_DISPATCH_KEY CUDA
#define VO_ON_DEVICE(t) (t).is_cuda()
#define VO_DEVICE_GUARD(t) const c10::cuda::OptionalCUDAGuard vo_guard_((t).device())
#define VO_SM_COUNT(t) at::cuda::getDeviceProperties((t).get_device())->multiProcessorCount
#define VO_WARP_SIZE(t) at::cuda::getDeviceProperties((t).get_device())->warpSize
// What a block may have: the device's opt-in maximum, capped by VO_SMEM_LIMIT (bytes) when set
// -- how an H100 runs the variants a 32 KB card would get (vo_env_limit, below).
#define VO_SMEM_OPTIN(t)                                                                   \
  std::min<int64_t>(                                                                       \
      static_cast<int64_t>(                                                                \
          at::cuda::getDeviceProperties((t).get_device())->sharedMemPerBlockOptin),        \
      vo_env_limit("VO_SMEM_LIMIT"))
#define VO_DYN_SMEM(type, name) extern __shared__ type name[]
// A kernel whose blocks ask for more than the 48 KB of dynamic shared memory every device
// grants by default must opt in before its launch (the device may still refuse: VO_LAUNCH).
#define VO_SMEM_OPT_IN(kernel, bytes)                                           \
  do {                                                                         \
    if ((bytes) > 48 * 1024)                                                   \
      C10_CUDA_CHECK(cudaFuncSetAttribute(                                     \
          (kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes))); \
  } while (0)
// The launch check turns a launch the device refuses (too much shared memory, too many
// registers for the block) into an exception at the call -- which the Python side can answer
// with the PyTorch path -- instead of a kernel that silently never ran.
#define VO_LAUNCH(kernel, grid, block, smem, ...)                                 \
  do {                                                                           \
    kernel<<<grid, block, smem, c10::cuda::getCurrentCUDAStream()>>>(__VA_ARGS__); \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                              \
  } while (0)
#endif

namespace {

// float, at::Half and at::BFloat16 only: float64 never reaches the device.
#define VO_DISPATCH_FLOATS(TYPE, NAME, ...)                          \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                     \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__) \
                             AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))

// For kernels templated on the warp width: f(std::integral_constant<int, 32 or 64>) with the
// width of t's device. Other widths raise here, before any launch (the Python callers answer
// a refused launch with their PyTorch / library path).
template <typename F>
void with_warp_width(const at::Tensor& t, const char* op, F&& f) {
  const int ws = VO_WARP_SIZE(t);
  TORCH_CHECK(ws == 32 || ws == 64, op, ": warps of ", ws, " lanes");
  if (ws == 64) f(std::integral_constant<int, 64>{});
  else f(std::integral_constant<int, 32>{});
}

#ifndef VO_BLOCK_THREADS
#define VO_BLOCK_THREADS 256
#endif
constexpr int kBlock = VO_BLOCK_THREADS;  // threads per block in every kernel (a multiple of 64)
#ifndef VO_GDN_BLOCK_THREADS
#define VO_GDN_BLOCK_THREADS 512
#endif
// GDN decode blocks are larger: one block per (sequence, key head) walks all R * V state rows.
constexpr int kGdnBlock = VO_GDN_BLOCK_THREADS;
constexpr int kMaxWarps = 32;
// Rows of one tile of the MoE grouped GEMM (moe_grouped_gemm.cu); moe_order maps its grid.
constexpr int kGroupedTileRows = 128;  // largest block (1024) / smallest warp we accept (32)

template <typename T>
__device__ __forceinline__ float to_f(T v) {
  return static_cast<float>(v);
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum over a group of `width` consecutive lanes (width a power of two <= 16: divides every
// warp size the target and NVIDIA have).
__device__ __forceinline__ float group_sum(float v, int width) {
  for (int o = width / 2; o > 0; o >>= 1) v += __shfl_xor_sync(__activemask(), v, o, width);
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = warpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(__activemask(), v, o);
  return v;
}

// Block-wide sum of N values per thread (result valid in every thread). `red` holds
// N * kMaxWarps floats.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], float* red) {
  const int lane = threadIdx.x % warpSize, warp = threadIdx.x / warpSize;
  const int nwarps = (blockDim.x + warpSize - 1) / warpSize;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
  __syncthreads();  // `red` may still be read by a previous call
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) red[i * kMaxWarps + warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float s = 0.f;
    for (int w = 0; w < nwarps; ++w) s += red[i * kMaxWarps + w];
    v[i] = s;
  }
}

// MoE routing of one token by a group of kRouteLanes consecutive lanes (a width that divides
// every warp size), over its E logits in `row` (NaN already replaced by -inf, so the ranks stay
// a permutation): top_k rounds of a group arg-max -- larger logit, then the lower expert index,
// upstream's order. Every lane of the group must call it (shuffles). Lane j < top_k gets pair
// j: its weight (softmax over the selected logits when `renormalize`, else over all E) and
// expert. Each lane owns the logits e = lane + i * kRouteLanes; up to kRouteRegs of them
// (E <= 256, Qwen3.5/3.6's 256 experts) stay in registers for all rounds, with the picked ones
// marked NaN (no comparison selects a NaN); a larger E re-reads `row` every round, as every E
// did before (H200, B = 1 decode step: the routed up kernel 16.3 -> 12.6 us a call).
constexpr int kRouteLanes = 16;
constexpr int kRouteRegs = 16;

// The group arg-max of one round: (bv, be) in, the group's best out, ties to the lower index.
__device__ __forceinline__ void group_argmax(float& bv, int& be) {
  for (int o = kRouteLanes / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(__activemask(), bv, o, kRouteLanes);
    const int oe = __shfl_xor_sync(__activemask(), be, o, kRouteLanes);
    if (ov > bv || (ov == bv && oe < be)) {
      bv = ov;
      be = oe;
    }
  }
}

// Round j's pick (bv, be) of group_topk: the largest logit (round 0) for the softmax, the
// renormalising denominator, and lane j keeps pair j.
__device__ __forceinline__ void topk_take(int j, int lane, bool renormalize, float bv, int be,
                                          float& mx, float& denom, float& my_v, int& my_e) {
  if (j == 0) mx = bv;
  if (renormalize) denom += expf(bv - mx);
  if (lane == j) {
    my_v = bv;
    my_e = be;
  }
}

__device__ __forceinline__ void group_topk(const float* __restrict__ row, int E, int top_k,
                                           bool renormalize, int lane, float& w_out,
                                           int& e_out) {
  float mx = 0.f, denom = 0.f, my_v = 0.f;
  int my_e = 0;
  if (E <= kRouteRegs * kRouteLanes) {
    float v[kRouteRegs];
#pragma unroll
    for (int i = 0; i < kRouteRegs; ++i) {
      const int e = lane + i * kRouteLanes;
      v[i] = e < E ? row[e] : NAN;  // padding is never picked
    }
    for (int j = 0; j < top_k; ++j) {
      float bv = -INFINITY;
      int bi = -1;
      // Ascending i is ascending e: the first of equal values wins; a -inf logit still beats
      // having none.
#pragma unroll
      for (int i = 0; i < kRouteRegs; ++i)
        if (v[i] > bv || (bi < 0 && v[i] == bv)) {
          bv = v[i];
          bi = i;
        }
      int be = bi < 0 ? 0x7fffffff : lane + bi * kRouteLanes;
      group_argmax(bv, be);
      if (be % kRouteLanes == lane) {
#pragma unroll
        for (int i = 0; i < kRouteRegs; ++i)
          if (i == be / kRouteLanes) v[i] = NAN;  // unrolled: v stays in registers
      }
      topk_take(j, lane, renormalize, bv, be, mx, denom, my_v, my_e);
    }
  } else {
    unsigned long long taken = 0;  // bit i: this lane's i-th logit chosen
    for (int j = 0; j < top_k; ++j) {
      float bv = -INFINITY;
      int be = 0x7fffffff;
      for (int e = lane, i = 0; e < E; e += kRouteLanes, ++i) {
        const float v = row[e];
        if (!((taken >> i) & 1ull) && (v > bv || (v == bv && e < be))) {
          bv = v;
          be = e;
        }
      }
      group_argmax(bv, be);
      if (be % kRouteLanes == lane) taken |= 1ull << (be / kRouteLanes);
      topk_take(j, lane, renormalize, bv, be, mx, denom, my_v, my_e);
    }
  }
  if (!renormalize) {  // the full softmax's denominator
    for (int e = lane; e < E; e += kRouteLanes) denom += expf(row[e] - mx);
    denom = group_sum(denom, kRouteLanes);
  }
  w_out = expf(my_v - mx) / denom;
  e_out = my_e;
}

// 16-byte vector of T (8 halves or 4 floats) converted to float.
template <typename T>
struct Vec {
  static constexpr int N = 16 / sizeof(T);
  float f[N];
  __device__ __forceinline__ void load(const T* p) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_f(e[i]);
  }
};

// Store Vec<T>::N floats as one 16-byte vector of T.
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float* f) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec<T>::N; ++i) e[i] = static_cast<T>(f[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// Largest s in [0, N) with starts[s] <= v, for cumulative starts[0..N] (starts[0] <= v <
// starts[N]): the sequence that owns token (or chunk) v. Empty sequences share their start with
// the next one; the last of them is the owner.
template <typename I>
__device__ __forceinline__ int owner_of(const I* __restrict__ starts, int N, int64_t v) {
  int lo = 0, hi = N;  // starts[lo] <= v < starts[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (static_cast<int64_t>(starts[mid]) <= v) lo = mid;
    else hi = mid;
  }
  return lo;
}

// ------------------------------------------------------------------------------------------
// Tensor cores through nvcuda::wmma 16x16x16 tiles (the portable form: no PTX, no CUTLASS;
// the emulation models it), shared by the GDN chunk and the MoE grouped-GEMM kernels.
// ------------------------------------------------------------------------------------------

namespace wmma = nvcuda::wmma;

// The 16-bit operand type for input T and its conversions (explicit intrinsics: torch builds
// define __CUDA_NO_HALF_CONVERSIONS__). The emulation uses at::Half / at::BFloat16 themselves.
template <typename T>
struct Mma;
#ifdef VO_CPU_EMULATION
template <typename T>
struct MmaEmu {
  using type = T;
  static type from(float f) { return static_cast<T>(f); }
  static float to(type v) { return static_cast<float>(v); }
};
template <>
struct Mma<at::Half> : MmaEmu<at::Half> {};
template <>
struct Mma<at::BFloat16> : MmaEmu<at::BFloat16> {};
#else
template <>
struct Mma<at::Half> {
  using type = __half;
  static __device__ __forceinline__ type from(float f) { return __float2half_rn(f); }
  static __device__ __forceinline__ float to(type v) { return __half2float(v); }
};
template <>
struct Mma<at::BFloat16> {
  using type = __nv_bfloat16;
  static __device__ __forceinline__ type from(float f) { return __float2bfloat16_rn(f); }
  static __device__ __forceinline__ float to(type v) { return __bfloat162float(v); }
};
#endif

// bf16 wmma needs sm_80; the host routes bf16 to the float32 kernels below that, and these
// kernels trap if ever launched there (the bf16 fragment types do not exist for those archs).
template <typename T>
__device__ constexpr bool mma_arch_ok() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  return !std::is_same<T, at::BFloat16>::value;
#else
  return true;
#endif
}

using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// A warp's float scratch tile for frag_out8: 16 rows kScrLd floats apart.
constexpr int kScrLd = 24;
constexpr int kScrWarp = 16 * kScrLd;

// The warp's accumulator tile through its scratch tile, by runs of 8: put8(r, c0, x) gets row
// r's columns c0 .. c0 + 7 (c0 = 0 or 8), so the caller packs 16-byte stores (one 16-byte
// store instead of eight 2-byte ones, and one call per lane instead of eight on 32-lane warps:
// fewer instructions, which bound the GDN state pass's serial path and its prep). 32 runs per
// tile, so lanes past 32 sit out. Warp-collective; `scr` is the warp's 32-byte aligned scratch
// tile of kScrWarp floats. Bank conflicts (shared memory wavefronts the accumulator's 8-byte
// stores and the 16-byte reads need): rows 24 floats apart put each half-warp's stores on
// distinct banks (16 apart, rows g and g + 2 collide), and odd lanes reading their second 16
// bytes first do the same for each quarter-warp's reads.
// WS: the warp width when the kernel knows it at compile time (0: read warpSize).
template <int WS = 0, typename F>
__device__ __forceinline__ void frag_out8(const FragC& f, float* __restrict__ scr, F&& put8) {
  wmma::store_matrix_sync(scr, f, kScrLd, wmma::mem_row_major);
  __syncwarp();
  const int ws = WS > 0 ? WS : warpSize;
  for (int e = threadIdx.x % ws; e < 32; e += ws) {
    const int h = (e % 2) * 4;
    const float* row = scr + (e / 2) * kScrLd + (e % 2) * 8;
    const float4 v0 = *reinterpret_cast<const float4*>(row + h);
    const float4 v1 = *reinterpret_cast<const float4*>(row + 4 - h);
    const float4 a = h ? v1 : v0, b = h ? v0 : v1;
    const float x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    put8(e / 2, (e % 2) * 8, x);
  }
  __syncwarp();
}

#ifdef VO_CPU_EMULATION
#define VO_MMA_SMEM(name) VO_DYN_SMEM(unsigned char, name)
#else
// wmma wants 256-bit aligned tile pointers: the kernels start every region on 128 bytes.
#define VO_MMA_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

}  // namespace
