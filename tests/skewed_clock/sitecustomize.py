"""Test-only: shift this process's wall clock (time.time, time.time_ns) by CHAOS_CLOCK_SHIFT_SECONDS.

tests/outages/test_chaos.py puts this directory first on a worker subprocess's PYTHONPATH, so the worker runs
with a clock ahead of everyone else's (libfaketime breaks time.sleep under this CPython). Monotonic
clocks and sleeps are untouched, as on a machine whose NTP is off.
"""

import os
import time

_SHIFT = float(os.environ.get("CHAOS_CLOCK_SHIFT_SECONDS") or 0)
if _SHIFT:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _SHIFT
    time.time_ns = lambda: _time_ns() + int(_SHIFT * 1e9)
