"""The test run's last guard: a thread a test left running must not hang the run at exit.

The interpreter joins every non-daemon thread (each executor's workers among them) before it
exits, so one loop that never ends keeps a finished run alive until CI kills it, with no word
of why. Once pytest is done, a watchdog gives the process two minutes to exit; past that it
prints every thread's stack and exits non-zero."""

from __future__ import annotations

import faulthandler
import sys

import pytest

EXIT_GRACE_S = 120


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.__stderr__)
