"""Fresh random inputs for every test, with the seed reported so a failure can be replayed.

Each test gets a new seed (from the OS) unless ``NATIVE_TEST_SEED`` is set; the seed is printed
(pytest shows captured output of failing tests) and attached to the test report.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
import torch

# The 0.32.0 line's glue (engines/v1_0_32/native_switch.py: torch.library.custom_op, torch 2.4+) and
# the tests that drive it are not collected on an older torch (the card's 2.1: .venv-v0). The
# shared ops they would also touch are covered there by tests/engines/v0/test_torch21_floor.py.
collect_ignore = (
    []
    if hasattr(torch.library, "custom_op")
    else [
        "test_decode_gemv_switch.py",
        "test_engine_moe.py",
        "test_gdn_checkpoint.py",
        "test_gdn_in_proj_merge.py",
    ]
)


@pytest.fixture(autouse=True)
def _one_cpu_thread() -> Iterator[None]:
    """The kernels under test are many small ops: on a shared 2-core box intra-op threading
    only adds contention (50x slower float64 reference loops under load), so use one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def native_seed(request: pytest.FixtureRequest) -> int:
    seed = int(os.environ.get("NATIVE_TEST_SEED", secrets.randbits(31)))
    torch.manual_seed(seed)
    print(f"NATIVE_TEST_SEED={seed}  (re-run with this env var to reproduce)")
    request.node.user_properties.append(("seed", seed))
    return seed
