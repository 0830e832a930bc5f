"""Our overlay on upstream vLLM 0.32.0 for Qwen3.5 / Qwen3.6 MoE.

Upstream files are touched only by the small diffs under ``patches/``; each diff calls into a
module of this package, where the logic lives.
"""

__version__ = "0.1.0"
TARGET_VLLM_VERSION = "0.32.0"
