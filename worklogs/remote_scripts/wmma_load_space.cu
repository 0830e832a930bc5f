// Which instructions do nvcuda::wmma bf16 fragment loads from shared memory become?
// Three ways to name the shared tile (dynamic shared memory plus an offset, the same with
// __builtin_assume(__isShared(p)), a static __shared__ array); worklogs/remote_scripts/
// wmma_load_sass.sh compiles this file and our kernels and counts the loads. On nvcc 13 /
// sm_90 (LEDGER, 2026-12-04) all three stay generic (wmma.load ... .bf16 without .shared in
// the PTX, LD.E in the SASS), while our fp16 loads get .shared and LDSM.
#include <mma.h>
#include <cuda_bf16.h>
using namespace nvcuda;
using FA = wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major>;
using FB = wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major>;
using FC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
// 1: dynamic smem, pointer from the symbol plus a run-time offset
__global__ void k_dyn(const __nv_bfloat16* g, float* out, int off) {
  extern __shared__ __align__(128) unsigned char smb[];
  __nv_bfloat16* a = reinterpret_cast<__nv_bfloat16*>(smb);
  __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(smb + off);
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) a[i] = g[i];
  __syncthreads();
  FA fa; FB fb; FC c; wmma::fill_fragment(c, 0.f);
  for (int k = 0; k < 64; k += 16) {
    wmma::load_matrix_sync(fa, a + k, 72);
    wmma::load_matrix_sync(fb, b + k, 72);
    wmma::mma_sync(c, fa, fb, c);
  }
  wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}
// 2: the same, with the pointers assumed shared
__global__ void k_assume(const __nv_bfloat16* g, float* out, int off) {
  extern __shared__ __align__(128) unsigned char smb[];
  __nv_bfloat16* a = reinterpret_cast<__nv_bfloat16*>(smb);
  __nv_bfloat16* b = reinterpret_cast<__nv_bfloat16*>(smb + off);
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) a[i] = g[i];
  __syncthreads();
  FA fa; FB fb; FC c; wmma::fill_fragment(c, 0.f);
  for (int k = 0; k < 64; k += 16) {
    const __nv_bfloat16* pa = a + k; const __nv_bfloat16* pb = b + k;
    __builtin_assume(__isShared(pa)); __builtin_assume(__isShared(pb));
    wmma::load_matrix_sync(fa, pa, 72);
    wmma::load_matrix_sync(fb, pb, 72);
    wmma::mma_sync(c, fa, fb, c);
  }
  wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}
// 3: a static shared array
__global__ void k_static(const __nv_bfloat16* g, float* out) {
  __shared__ __align__(128) __nv_bfloat16 a[64 * 72], b[64 * 72];
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) { a[i] = g[i]; b[i] = g[i + 1]; }
  __syncthreads();
  FA fa; FB fb; FC c; wmma::fill_fragment(c, 0.f);
  for (int k = 0; k < 64; k += 16) {
    wmma::load_matrix_sync(fa, a + k, 72);
    wmma::load_matrix_sync(fb, b + k, 72);
    wmma::mma_sync(c, fa, fb, c);
  }
  wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}
