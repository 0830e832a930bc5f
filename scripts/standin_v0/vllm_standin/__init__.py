"""The stand-in's harness: vLLM 0.6.3's GPU worker and model runner, run on CPU tensors.

Stand-in only (``vllm_overrides/engines/v0/STANDIN.md``): installed into the stand-in venv by
``build_env.sh``, never into the image. ``repack_vllm.py`` routes vLLM's device "cpu" to
:mod:`vllm_standin.executor` when this package is importable, so the engine runs the card's
``vllm.worker.worker.Worker`` / ``ModelRunner`` (chunked prefill, prefix caching, the
seqlen-agnostic kwargs) instead of upstream's CPU worker, which supports none of them.
"""
