// Test build of every kernel source (*.cu) in one unit: the same kernels and host wrappers, run on
// host threads (cpu_emulation.h) and registered for CPU tensors. Built by
// kernels.enable_cpu_emulation() for the emulated cases of tests/native/test_*_kernels.py; never
// shipped or used by the server.
#define VO_CPU_EMULATION 1
#include "gdn_chunk.cu"
#include "gdn_conv.cu"
#include "moe_grouped_gemm.cu"
#include "moe_prefill.cu"
#include "native_kernels.cu"
#include "paged_attention.cu"

TORCH_LIBRARY_FRAGMENT(vo_kernels, m) {
  // The emulated warp width (a GPU's is fixed; the tests run the target's 64 and NVIDIA's 32).
  m.def("emu_set_warp_size", [](int64_t w) { warpSize = static_cast<int>(w); });
  // The shared memory a block may have (tests of a smaller device than the H200's 227 KB).
  m.def("emu_set_smem_optin", [](int64_t bytes) { smemPerBlockOptin = bytes; });
}
