"""Iluvatar-portable native kernels for Qwen3.5 / Qwen3.6 MoE (plain PyTorch, no Triton).

* :mod:`.gdn` -- Gated DeltaNet: causal conv1d (prefill/decode), chunked gated delta rule
  (prefill, varlen, chunk-level parallel scan), recurrent decode step, gates, gated RMSNorm.
* :mod:`.moe` -- router top-k, shared expert, sort-by-expert grouped prefill, decode paths.
* :mod:`.rmsnorm` -- Qwen3.5's ``(1 + w)`` RMSNorm (+ fused residual add) and the plain gated
  norm of the GDN output.

Each has a float64 loop reference beside it (``*_reference.py``) used by ``tests/native``.
All tensor layouts are vLLM 0.32.0's, so weights and caches are shared with the engine as is.
"""

from . import gdn, moe, rmsnorm

__all__ = ["gdn", "moe", "rmsnorm"]
