"""What touches one vLLM generation's internals: one folder per engine generation."""
