// GDN prefill front end (vllm_overrides.native.kernels.gdn_conv_prep): the causal conv1d over
// packed varlen sequences with the post-conv prep, in two launches instead of the PyTorch path's
// ~40 (gdn.causal_conv1d_prefill + gdn.post_conv_prep, which round-trip [T, D] float32
// intermediates through memory).
//
//   1. gdn_conv_prep_kernel, one block per group of kConvRows consecutive tokens (grid-stride;
//      one token where two rows of D do not fit the shared memory): each thread takes 16-byte
//      vectors of channels (their conv weights as whole vectors too; width 4 only) and issues
//      all the group's loads (weights, bias, the R + W - 1 input rows) before using any; out =
//      act(bias + sum_j w[:, j] x[t - (W-1) + j]) with the W-1 positions before a token's
//      sequence taken from its conv state (zeros without an initial state; a group may span
//      sequences), rounded to the input type as upstream's conv output is; then q and k
//      l2-normalised per head from those rounded values (float32, eps 1e-6; FLA's l2norm_fwd
//      numerics) and rounded again; v copied out; the gates g = -exp(A_log) softplus(a +
//      dt_bias), beta = sigmoid(b) in float32. The rounded conv rows are staged in shared
//      memory (16-bit rows stay 16-bit) so the head norms need one barrier a group.
//   2. gdn_conv_state_kernel, one thread per (sequence, channel): the new conv state = the last
//      W-1 inputs of [initial columns | sequence]. A launch of its own because kernel 1's first
//      tokens of a sequence read the old state.
//
// Same contract and results as the PyTorch path (tests/native/test_gdn_conv_kernels.py): the
// sequence of each token is found by a binary search over cu_seqlens on the device (no host
// sync); sequences whose slot is `pad_slot_id` keep their state, and like the PyTorch path they
// read slot 0's columns as history when marked as having an initial state.
//
// Portability as in common.cuh: no warp size assumed (the head norms go through shared memory),
// block size kBlock, float32 accumulation, no float64 on the device.
#include "common.cuh"

namespace {

// The conv width the kernel is built for (Qwen3.5 / 3.6: linear_conv_kernel_dim 4); the
// weights of a thread's channels then sit in registers. Other widths take the PyTorch path.
constexpr int kConvWidth = 4;

// Tokens a block takes at a time, and the blocks an SM must hold. A/B on the H200 (16K tokens,
// D 2048, bf16; worklogs/LEDGER.md): one token a block with each tap's load behind a branch
// took 223 us; all of a group's loads issued first 158 us (1 token), 123 us (2), 138 us (4);
// 2 tokens at >= 4 blocks an SM (ptxas: 64 registers, no spill) 107 us; 4 tokens at >= 3
// blocks 112 us, and 8 tokens spilled there.
constexpr int kConvRows = 2;
// That bound is nvcc's. clang (the target's CoreX is a clang) needs about twice the registers
// for this kernel: held to 64 it spilled 36-340 bytes a thread in 22 of its 24 instantiations
// at sm_70 and sm_90 (clang 19 + ptxas 12.5, scripts/clang_kernels_check.py; LEDGER); with the
// block size alone, the 2-token kernel takes 118-170 and spills nothing. On a memory-bound
// kernel we would rather give up occupancy than add local-memory traffic (not timed on the
// target), so clang gets only the block size.
#ifdef VO_CPU_EMULATION
#define VO_CONV_BOUNDS
#elif defined(__clang__)
#define VO_CONV_BOUNDS __launch_bounds__(kBlock)
#else
#define VO_CONV_BOUNDS __launch_bounds__(kBlock, 4)
#endif

template <typename T, typename I, int W, int R>
__global__ void VO_CONV_BOUNDS gdn_conv_prep_kernel(
    const T* __restrict__ x, int64_t s_x, int64_t T_, int D,                      // [T, D]
    const T* __restrict__ w, const T* __restrict__ bias,                         // [D, W], [D]
    const T* __restrict__ cs, int64_t cs_slot, int64_t cs_d, int64_t cs_w,       // [S, D, W-1]
    const I* __restrict__ cu, int N, const int64_t* __restrict__ slots,
    const bool* __restrict__ has_init, bool silu,
    const T* __restrict__ a, int64_t s_a, const T* __restrict__ b, int64_t s_b,  // [T, HV]
    const float* __restrict__ A_log, const float* __restrict__ dt_bias, int H, int HV, int K,
    bool l2, T* __restrict__ q_out, T* __restrict__ k_out, T* __restrict__ v_out,
    float* __restrict__ g_out, float* __restrict__ beta_out) {
  constexpr int NV = Vec<T>::N;
  constexpr int S = W - 1;
  // y [R][D] (the rounded conv rows, exact in T), then part [R][D / NV] (squares per vector).
  VO_DYN_SMEM(float, sm);
  T* y = reinterpret_cast<T*>(sm);
  float* part = sm + (R * D * static_cast<int>(sizeof(T)) + 3) / 4;
  const int HK = H * K, vpk = K / NV, DV = D / NV;
  for (int64_t t0 = (int64_t)blockIdx.x * R; t0 < T_; t0 += (int64_t)gridDim.x * R) {
    const int nr = static_cast<int>(T_ - t0 < R ? T_ - t0 : R);
    // The group's tokens may belong to different sequences: each its own start and history.
    int64_t start[R];
    const T* st[R];
    bool init[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int n = owner_of(cu, N, t0 + (r < nr ? r : nr - 1));
      start[r] = cu[n];
      st[r] = cs + (slots[n] < 0 ? 0 : slots[n]) * cs_slot;  // pad slots read slot 0, as gdn.py
      init[r] = has_init == nullptr || has_init[n];
    }
    for (int c0 = threadIdx.x * NV; c0 < D; c0 += blockDim.x * NV) {
      // Every 16-byte load of the group is issued before any is used: the W taps (the weights
      // are read by every group: scalar loads here were most of the kernel's time), the bias
      // and the R + W - 1 input rows, each row read once for the group's R tokens. Rows before
      // the tensor or after its end are clamped in bounds and never used (a token reads history
      // before its sequence's start, and no row past its own).
      uint4 wr[W], xr[R + S], br{};
#pragma unroll
      for (int i = 0; i < W; ++i)
        wr[i] = *reinterpret_cast<const uint4*>(w + (int64_t)c0 * W + i * NV);
      if (bias != nullptr) br = *reinterpret_cast<const uint4*>(bias + c0);
#pragma unroll
      for (int i = 0; i < R + S; ++i) {
        int64_t src = t0 - S + i;
        src = src < 0 ? 0 : (src >= T_ ? T_ - 1 : src);
        xr[i] = *reinterpret_cast<const uint4*>(x + src * s_x + c0);
      }
      const T* wv = reinterpret_cast<const T*>(wr);  // [NV][W]
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= nr) break;
        float acc[NV];
#pragma unroll
        for (int u = 0; u < NV; ++u)
          acc[u] = bias != nullptr ? to_f(reinterpret_cast<const T*>(&br)[u]) : 0.f;
        const int64_t t = t0 + r;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const int64_t src = t - S + j;
          const T* xv = reinterpret_cast<const T*>(&xr[r + j]);
          if (src >= start[r]) {
#pragma unroll
            for (int u = 0; u < NV; ++u) acc[u] += to_f(wv[u * W + j]) * to_f(xv[u]);
          } else if (init[r]) {  // history column S + (src - start) of the sequence's state
            const int64_t col = S + (src - start[r]);
#pragma unroll
            for (int u = 0; u < NV; ++u)
              acc[u] += to_f(wv[u * W + j]) * to_f(st[r][(c0 + u) * cs_d + col * cs_w]);
          }
        }
        uint4 yr;
        T* ye = reinterpret_cast<T*>(&yr);
        float sq = 0.f;
#pragma unroll
        for (int u = 0; u < NV; ++u) {
          ye[u] = static_cast<T>(silu ? silu_f(acc[u]) : acc[u]);
          const float f = to_f(ye[u]);
          sq += f * f;
        }
        *reinterpret_cast<uint4*>(y + r * D + c0) = yr;
        part[r * DV + c0 / NV] = sq;
      }
    }
    for (int e = threadIdx.x; e < nr * HV; e += blockDim.x) {
      const int64_t t = t0 + e / HV;
      const int hv = e % HV;
      const float xa = to_f(a[t * s_a + hv]) + dt_bias[hv];
      const float sp = xa > 20.f ? xa : log1pf(expf(xa));  // softplus, threshold 20
      g_out[t * HV + hv] = -expf(A_log[hv]) * sp;
      beta_out[t * HV + hv] = sigmoid_f(to_f(b[t * s_b + hv]));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nr * DV; e += blockDim.x) {
      const int r = e / DV, c0 = (e % DV) * NV;
      const int64_t t = t0 + r;
      float f = 1.f;
      if (l2 && c0 < 2 * HK) {
        const float* pr = part + r * DV + (c0 / K) * vpk;  // this head's vectors
        float ss = 0.f;
        for (int i = 0; i < vpk; ++i) ss += pr[i];
        f = rsqrtf(ss + 1e-6f);
      }
      Vec<T> yv;
      yv.load(y + r * D + c0);
      float o[NV];
#pragma unroll
      for (int u = 0; u < NV; ++u) o[u] = yv.f[u] * f;
      if (c0 < HK) store_vec(q_out + t * HK + c0, o);
      else if (c0 < 2 * HK) store_vec(k_out + t * HK + (c0 - HK), o);
      else store_vec(v_out + t * (D - 2 * HK) + (c0 - 2 * HK), o);
    }
    __syncthreads();  // y / part are rewritten for the next group
  }
}

template <typename T, typename I>
__global__ void gdn_conv_state_kernel(const T* __restrict__ x, int64_t s_x, int D,
                                      T* __restrict__ cs, int64_t cs_slot, int64_t cs_d,
                                      int64_t cs_w, int W, const I* __restrict__ cu,
                                      const int64_t* __restrict__ slots,
                                      const bool* __restrict__ has_init, int64_t pad_slot_id) {
  const int n = blockIdx.x, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= D || slots[n] == pad_slot_id) return;
  const int S = W - 1;
  const int64_t start = cu[n], len = static_cast<int64_t>(cu[n + 1]) - start;
  const bool init = has_init == nullptr || has_init[n];
  T* st = cs + (slots[n] < 0 ? 0 : slots[n]) * cs_slot + (int64_t)c * cs_d;
  // Column s takes input len - S + s of [initial columns | sequence]: a later column of the old
  // state (read before it is overwritten, as s only grows) or a token.
  for (int s = 0; s < S; ++s) {
    const int64_t rel = len - S + s;
    const T v = rel >= 0 ? x[(start + rel) * s_x + c]
                : init   ? st[(S + rel) * cs_w]
                         : static_cast<T>(0.f);
    st[s * cs_w] = v;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gdn_conv_prep(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    at::Tensor& conv_states, const at::Tensor& cu_seqlens, const at::Tensor& slots,
    const c10::optional<at::Tensor>& has_init, bool silu, const at::Tensor& a,
    const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias, int64_t H,
    int64_t K, int64_t V, bool l2, int64_t pad_slot_id) {
  TORCH_CHECK(VO_ON_DEVICE(x) && x.dim() == 2 && x.stride(1) == 1, "gdn_conv_prep: x [T, D]");
  const int64_t T = x.size(0), D = x.size(1);
  const int NV = 16 / static_cast<int>(x.element_size());
  TORCH_CHECK(K % NV == 0 && V % NV == 0 && D > 2 * H * K && (D - 2 * H * K) % V == 0,
              "gdn_conv_prep: D = 2HK + HV*V with K, V whole 16-byte vectors");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  (x.stride(0) * x.element_size()) % 16 == 0,
              "gdn_conv_prep: rows of x must be 16-byte aligned");
  const int64_t HV = (D - 2 * H * K) / V;
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == D && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "gdn_conv_prep: weight [D, W] contiguous, x's dtype");
  const int64_t W = weight.size(1);
  TORCH_CHECK(W == kConvWidth, "gdn_conv_prep: conv width 4 (Qwen3.5 / 3.6)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              "gdn_conv_prep: weight 16-byte aligned");
  if (bias.has_value())
    TORCH_CHECK(bias->numel() == D && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type() &&
                    reinterpret_cast<uintptr_t>(bias->data_ptr()) % 16 == 0,
                "gdn_conv_prep: bias [D], x's dtype, 16-byte aligned");
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.size(1) == D &&
                  conv_states.size(2) == W - 1 && conv_states.scalar_type() == x.scalar_type(),
              "gdn_conv_prep: conv_states [slots, D, W-1] in x's dtype (any strides)");
  const int64_t N = cu_seqlens.numel() - 1;
  TORCH_CHECK(N >= 0 && cu_seqlens.dim() == 1 && cu_seqlens.is_contiguous() &&
                  (cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong),
              "gdn_conv_prep: cu_seqlens [N+1] int32/int64");
  TORCH_CHECK(slots.numel() == N && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "gdn_conv_prep: slots [N] int64");
  if (has_init.has_value())
    TORCH_CHECK(has_init->numel() == N && has_init->scalar_type() == at::kBool &&
                    has_init->is_contiguous(),
                "gdn_conv_prep: has_initial_state [N] bool");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == T && b.size(0) == T &&
                  a.size(1) == HV && b.size(1) == HV && a.stride(1) == 1 && b.stride(1) == 1 &&
                  a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(),
              "gdn_conv_prep: a, b [T, HV] in x's dtype, unit stride");
  TORCH_CHECK(A_log.numel() == HV && dt_bias.numel() == HV &&
                  A_log.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat &&
                  A_log.is_contiguous() && dt_bias.is_contiguous(),
              "gdn_conv_prep: A_log, dt_bias [HV] float32");
  TORCH_CHECK(HV <= kBlock, "gdn_conv_prep: HV <= block size");
  VO_DEVICE_GUARD(x);
  auto q = at::empty({T, H, K}, x.options());
  auto k = at::empty({T, H, K}, x.options());
  auto v = at::empty({T, HV, V}, x.options());
  auto g = at::empty({T, HV}, x.options().dtype(at::kFloat));
  auto beta = at::empty({T, HV}, x.options().dtype(at::kFloat));
  if (N == 0) return {q, k, v, g, beta};
  const bool* hi = has_init.has_value() ? has_init->data_ptr<bool>() : nullptr;
  // kConvRows tokens a block where their staged rows fit the 48 KB of shared memory any
  // device grants without opting in (D 2048: 10 KB), else one.
  const int64_t per_row = D * x.element_size() + (D / NV) * 4;
  const int rows = kConvRows * per_row + 4 <= 48 * 1024 ? kConvRows : 1;
  const size_t smem = rows * per_row + 4;
  VO_DISPATCH_FLOATS(x.scalar_type(), "gdn_conv_prep", [&] {
    using T_ = scalar_t;
    const T_* bp = bias.has_value() ? bias->data_ptr<T_>() : nullptr;
    auto launch = [&](auto* cu) {
      using I_ = std::remove_const_t<std::remove_pointer_t<decltype(cu)>>;
      auto prep = [&](auto r) {
        constexpr int R = decltype(r)::value;
        VO_LAUNCH((gdn_conv_prep_kernel<T_, I_, kConvWidth, R>),
            std::min<int64_t>((T + R - 1) / R, 65535), kBlock, smem, x.data_ptr<T_>(),
            x.stride(0), T, static_cast<int>(D), weight.data_ptr<T_>(), bp,
            conv_states.data_ptr<T_>(), conv_states.stride(0), conv_states.stride(1),
            conv_states.stride(2), cu, static_cast<int>(N), slots.data_ptr<int64_t>(), hi,
            silu, a.data_ptr<T_>(), a.stride(0), b.data_ptr<T_>(), b.stride(0),
            A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), static_cast<int>(H),
            static_cast<int>(HV), static_cast<int>(K), l2, q.data_ptr<T_>(), k.data_ptr<T_>(),
            v.data_ptr<T_>(), g.data_ptr<float>(), beta.data_ptr<float>());
      };
      if (T > 0) {
        if (rows == kConvRows) prep(std::integral_constant<int, kConvRows>());
        else prep(std::integral_constant<int, 1>());
      }
      VO_LAUNCH((gdn_conv_state_kernel<T_, I_>), dim3(N, (D + kBlock - 1) / kBlock), kBlock, 0,
          x.data_ptr<T_>(), x.stride(0), static_cast<int>(D), conv_states.data_ptr<T_>(),
          conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
          static_cast<int>(W), cu, slots.data_ptr<int64_t>(), hi, pad_slot_id);
    };
    if (cu_seqlens.scalar_type() == at::kInt) launch(cu_seqlens.data_ptr<int32_t>());
    else launch(cu_seqlens.data_ptr<int64_t>());
  });
  return {q, k, v, g, beta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vo_kernels, m) {
  m.def("gdn_conv_prep(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states,"
        " Tensor cu_seqlens, Tensor slots, Tensor? has_initial_state, bool silu, Tensor a,"
        " Tensor b, Tensor A_log, Tensor dt_bias, int num_k_heads, int head_k_dim,"
        " int head_v_dim, bool l2norm, int pad_slot_id)"
        " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(vo_kernels, VO_DISPATCH_KEY, m) { m.impl("gdn_conv_prep", &gdn_conv_prep); }
