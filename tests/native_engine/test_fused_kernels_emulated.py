"""The engine's calls into the fused kernels, end to end on the CPU.

With ``NATIVE_KERNELS=emulate`` the CPU server runs the fused kernels' own CUDA source on host
threads (``csrc/cpu_emulation.h``) wherever a GPU would run them -- the GDN decode step on
vLLM's conv / SSM cache slots, the gated and ``(1 + w)`` norms, MoE routing and the routed
experts (decode and the 500-token prompt's prefill), the GDN prefill's conv + prep and chunk
rule, the attention layers' q/k norm + RoPE -- so the wiring (cache views, slot indices, padded batches, dtypes) is checked against
the transformers oracle in float32, as the PyTorch path is in ``test_native_oracle.py``.
Speed means nothing here (each emulated launch runs its blocks on fibers).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.native_engine.enginelib import NATIVE_ON, engine_server, greedy, greedy_many
from tests.native_engine.enginelib import check_same_tokens as _check
from tests.serverlib import REPO_DIR

pytestmark = pytest.mark.server
LOG = REPO_DIR / "build" / "native-engine-fused-emulated.log"


@pytest.fixture(scope="module")
def url(oracle: dict[str, Any]) -> Iterator[str]:
    # The fused GDN chunk prefill is opt-in in the code (the YAML turns it on): on here.
    env = {**NATIVE_ON, "NATIVE_KERNELS": "emulate", "GDN_CHUNK_KERNEL": "fused"}
    with engine_server(LOG, env, ["--dtype", "float32"]) as u:
        yield u


@pytest.mark.parametrize("name", ["len20", "len500"])
def test_fused_greedy_matches_hf(url: str, oracle: dict[str, Any], name: str) -> None:
    want = oracle[name]
    got = greedy(url, want["prompt"], max_tokens=32)
    want = {**want, **{k: want[k][:32] for k in ("tokens", "logprobs")}}
    _check(name, got, want)
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert worst < 1e-3, f"{name}: max chosen-token logprob difference {worst:.3g}"


def test_fused_concurrent_batch_matches_hf(url: str, oracle: dict[str, Any]) -> None:
    names = [f"batch{i}" for i in range(4)]
    results = greedy_many(url, [oracle[n]["prompt"] for n in names], max_tokens=16)
    for name, got in zip(names, results, strict=True):
        want = oracle[name]
        _check(name, got, {**want, **{k: want[k][:16] for k in ("tokens", "logprobs")}})


def test_fused_kernels_served_the_engine(url: str, oracle: dict[str, Any]) -> None:
    text = LOG.read_text(errors="replace")
    assert "NATIVE_KERNELS=emulate: fused kernels on host threads" in text
    used = " ".join(ln for ln in text.splitlines() if "native paths in use" in ln)
    # gdn_decode_norm_fused: decode-only steps take the GDN output norm inside gdn_decode.
    for key in ("gdn_core", "gdn_decode_norm_fused", "rms_norm_gated", "gemma_rms_norm",
                "moe_decode_native", "qk_norm_rope_gate"):  # fmt: skip
        assert key in used, f"{key} not reported as used: {used}"
    # ... and each of them ran on the fused kernels, not their PyTorch fallbacks.
    for op in ("gdn_decode", "rms_norm_gated", "gemma_rms_norm", "moe_route", "moe_decode",
               "moe_prefill", "gdn_conv_prep", "gdn_chunk_prefill", "qk_norm_rope_gate"):  # fmt: skip
        assert f"fused_{op}" in used, f"{op} did not run on the fused kernels: {used}"
    assert "Traceback" not in text
