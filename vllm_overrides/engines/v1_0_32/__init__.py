"""The 0.32.0 line: our overlay on upstream vLLM 0.32.0 (the CPU behavioural reference)."""
