"""The platform line: our overlay on vLLM 0.6.3(+corex), the V0 engine of the platform's base."""
