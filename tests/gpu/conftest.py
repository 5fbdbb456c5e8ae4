import sys
import time

import pytest


@pytest.fixture(autouse=True)
def drivers_clock_starts_with_the_test(monkeypatch):
    """The drivers count their budget from dyn_device's import (`el()`), and Python imports it once
    per test session: without this, a driver test run 520 s into the suite finds its budget spent
    and skips the work it is meant to check (CI failed on it once)."""
    dyn_device = sys.modules.get("dyn_device")
    if dyn_device is not None:
        monkeypatch.setattr(dyn_device, "T0", time.time())
