"""``--tool-parser-plugin`` target: vLLM 0.6.3 loads a plugin by *file path* before it builds
the app, then checks ``--tool-call-parser`` against its registry. Importing the package module
registers ``qwen3_coder`` once, under one class identity, whoever imports it first."""

import vllm_overrides.engines.v0.tool_parser  # noqa: F401  (registers on import)
