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
