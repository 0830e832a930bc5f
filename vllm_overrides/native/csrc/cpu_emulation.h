// The CUDA execution model on the host, for testing native_kernels.cu on a machine without a GPU
// (tests/native/test_cuda_kernels.py builds it through kernels.enable_cpu_emulation()). Never
// shipped.
//
// One launch runs its blocks one after another; the threads of a block are cooperative fibers
// (ucontext) on one OS thread, so __syncthreads() is a real barrier and block-level `__shared__`
// variables can be plain statics. Warps are `warpSize` consecutive threads (a runtime value, as
// on a GPU: the tests run 64, the target's width, and 32). A shuffle writes a per-thread slot and
// waits on its warp's barrier, so a shuffle or __syncthreads that not every thread reaches is
// caught as a deadlock (an error naming the block), as such divergence is undefined on a device.
// Dynamic shared memory starts as NaN bytes, so a read before a write shows up in results.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

// Block size of the test build: two 64-lane warps (four 32-lane ones), so cross-warp
// reductions are exercised, at half the fibers of the production 256.
#define VO_BLOCK_THREADS 128
#define VO_GDN_BLOCK_THREADS 128

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned long long x_ = 1, unsigned long long y_ = 1, unsigned long long z_ = 1)
      : x(static_cast<unsigned>(x_)), y(static_cast<unsigned>(y_)), z(static_cast<unsigned>(z_)) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

inline dim3 threadIdx;  // set by the scheduler before it resumes a fiber
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
inline int warpSize = 64;
// Shared memory a block may have, in bytes (an H200's opt-in limit unless a test lowers it): a
// launch that asks for more is refused, as a device refuses it.
inline int64_t smemPerBlockOptin = 227 * 1024;

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max;
using std::min;

namespace vo_emu {

constexpr size_t kStack = 256 * 1024;

struct Barrier {
  int n;
  int count = 0;
  unsigned long generation = 0;
};

struct Launch {
  std::vector<ucontext_t> ctx;
  std::vector<char> done;
  ucontext_t main;
  int cur = 0;
  unsigned long progress = 0;  // barriers completed + threads finished
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<unsigned long long> slots[2];  // double-buffered shuffle slots
  std::vector<int> parity;                   // which buffer each thread's next shuffle uses
  std::vector<unsigned char> smem;
  const std::function<void()>* body = nullptr;
};
inline Launch* current = nullptr;

inline void yield() {
  Launch& l = *current;
  swapcontext(&l.ctx[l.cur], &l.main);
}

inline void wait(Barrier& b) {
  const unsigned long gen = b.generation;
  if (++b.count == b.n) {
    b.count = 0;
    ++b.generation;
    ++current->progress;
    return;
  }
  while (b.generation == gen) yield();
}

inline void trampoline() {
  Launch& l = *current;
  (*l.body)();
  l.done[l.cur] = 1;
  ++l.progress;
  swapcontext(&l.ctx[l.cur], &l.main);  // never resumed
}

inline void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  const int n = static_cast<int>(block.x);
  if (block.y != 1 || block.z != 1 || n % warpSize != 0)
    throw std::runtime_error("vo cpu emulation: 1-D blocks of whole warps only");
  if (static_cast<int64_t>(smem_bytes) > smemPerBlockOptin)
    throw std::runtime_error("vo cpu emulation: more shared memory than a block may have");
  Launch l;
  l.ctx.resize(n);
  l.done.assign(n, 0);
  static std::vector<std::unique_ptr<char[]>> pool;  // fiber stacks, kept across launches
  while (pool.size() < static_cast<size_t>(n)) pool.emplace_back(new char[kStack]);
  l.block.n = n;
  l.warps.assign(n / warpSize, Barrier{warpSize});
  l.slots[0].assign(n, 0);
  l.slots[1].assign(n, 0);
  l.parity.assign(n, 0);
  l.smem.assign(smem_bytes + 16, 0xFF);  // NaN floats until written
  l.body = &body;
  Launch* outer = current;
  current = &l;
  blockDim = block;
  gridDim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3(x, y, z);
        for (int t = 0; t < n; ++t) {
          getcontext(&l.ctx[t]);
          l.ctx[t].uc_stack.ss_sp = pool[t].get();
          l.ctx[t].uc_stack.ss_size = kStack;
          l.ctx[t].uc_link = nullptr;
          makecontext(&l.ctx[t], trampoline, 0);
          l.done[t] = 0;
        }
        int finished = 0;
        while (finished < n) {
          const unsigned long before = l.progress;
          finished = 0;
          for (int t = 0; t < n; ++t) {
            if (l.done[t]) {
              ++finished;
              continue;
            }
            l.cur = t;
            threadIdx = dim3(t);
            swapcontext(&l.main, &l.ctx[t]);
            finished += l.done[t];
          }
          if (finished < n && l.progress == before) {
            current = outer;
            throw std::runtime_error(
                "vo cpu emulation: deadlock in block (" + std::to_string(x) + "," +
                std::to_string(y) + "): a __syncthreads or shuffle not reached by every thread");
          }
        }
      }
  current = outer;
}

}  // namespace vo_emu

inline void __syncthreads() { vo_emu::wait(vo_emu::current->block); }
// Fibers of one OS thread never interleave inside an expression: a plain read-modify-write.
template <typename T>
inline T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
inline unsigned long long __activemask() { return ~0ull; }
// Blocks run one after another: every write is visible to the next block.
inline void __threadfence() {}

template <typename T>
inline T __shfl_xor_sync(unsigned long long, T v, int lane_mask, int width = warpSize) {
  static_assert(sizeof(T) <= sizeof(unsigned long long), "shuffle of a wide type");
  auto& l = *vo_emu::current;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % warpSize, warp = tid / warpSize;
  auto& slots = l.slots[l.parity[tid]];
  l.parity[tid] ^= 1;
  std::memcpy(&slots[tid], &v, sizeof(T));
  vo_emu::wait(l.warps[warp]);
  int src = lane ^ lane_mask;
  if (src / width != lane / width || src >= warpSize) src = lane;  // later group: own value
  T r;
  std::memcpy(&r, &slots[warp * warpSize + src], sizeof(T));
  return r;
}

[[noreturn]] inline void __trap() { std::abort(); }

// __syncwarp: a barrier of the calling thread's warp (the same one shuffles wait on).
inline void __syncwarp(unsigned long long = ~0ull) {
  vo_emu::wait(vo_emu::current->warps[static_cast<int>(threadIdx.x) / warpSize]);
}

// A minimal nvcuda::wmma (16x16x16 only): every thread of the warp holds the whole tile in its
// fragment, row-major (element (r, c) at x[r * 16 + c]), and computes the whole product, so
// loads, stores and mma_sync need no cooperation between the fibers (a store from every lane
// writes the same values). Uniform element-wise ops on x[0 .. num_elements) behave as on a
// device, where each lane holds an unspecified share of the tile. Products accumulate in float.
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "vo wmma emulation: 16x16x16 tiles only");
  static constexpr int num_elements = 256;
  T x[256];
};

template <typename Use, typename T, typename L>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, T v) {
  for (int e = 0; e < 256; ++e) f.x[e] = v;
}
template <typename Use, typename T, typename L, typename V>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, V v) {
  for (int e = 0; e < 256; ++e) f.x[e] = static_cast<T>(v);
}

// matrix_a / matrix_b: the memory layout is the fragment's.
template <typename Use, typename T, typename L>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
  static_assert(std::is_same<L, row_major>::value || std::is_same<L, col_major>::value,
                "an operand fragment needs a layout");
  constexpr bool row = std::is_same<L, row_major>::value;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.x[r * 16 + c] = row ? p[r * ldm + c] : p[c * ldm + r];
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.x[r * 16 + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * 16 + c];
}

// d = a b + c (d may be c).
template <typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, T, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
  float af[256], bf[256], out[256];
  for (int e = 0; e < 256; ++e) {
    af[e] = static_cast<float>(a.x[e]);
    bf[e] = static_cast<float>(b.x[e]);
  }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 16; ++n) {
      float s = c.x[r * 16 + n];
      for (int k = 0; k < 16; ++k) s += af[r * 16 + k] * bf[k * 16 + n];
      out[r * 16 + n] = s;
    }
  for (int e = 0; e < 256; ++e) d.x[e] = out[e];
}
}  // namespace wmma
}  // namespace nvcuda

#define VO_DISPATCH_KEY CPU
#define VO_ON_DEVICE(t) (t).is_cpu()
#define VO_DEVICE_GUARD(t) (void)(t)
// An H200's SM count, so that the tests' batch sizes take both of a kernel's grid layouts.
#define VO_SM_COUNT(t) ((void)(t), 132)
#define VO_WARP_SIZE(t) ((void)(t), warpSize)
// VO_SMEM_LIMIT caps it as on a device (the variant choice); launches are still checked
// against smemPerBlockOptin alone.
#define VO_SMEM_OPTIN(t) \
  ((void)(t), std::min<int64_t>(smemPerBlockOptin, vo_env_limit("VO_SMEM_LIMIT")))
// Nothing to opt in to: launch() checks the request against smemPerBlockOptin.
#define VO_SMEM_OPT_IN(kernel, bytes) ((void)(kernel), (void)(bytes))
#define VO_DYN_SMEM(type, name) type* name = reinterpret_cast<type*>(vo_emu::current->smem.data())
#define VO_LAUNCH(kernel, grid, block, smem, ...) \
  vo_emu::launch(dim3(grid), dim3(block), (smem), [&] { kernel(__VA_ARGS__); })
