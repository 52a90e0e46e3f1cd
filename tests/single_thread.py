"""An autouse fixture for modules of tiny-model tests: import `one_thread` into the test module to use it."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # On tiny matrices a second thread only adds contention, and on a shared 2-core machine a lot of it.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
