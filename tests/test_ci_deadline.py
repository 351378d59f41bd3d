"""CI's time budget (tests/conftest.py's ``TETHER_TEST_DEADLINE``, set by .ci/run): a test expected to end past the
deadline is skipped and says why; the others still run. Run as a user would: pytest in a subprocess."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from helpers import subprocess_env

TESTS = Path(__file__).resolve().parent
ORGANISM = "tests/test_organism_learns.py::test_the_default_organism_run_learns"  # slow(minutes=22)
QUICK = "tests/test_ci_deadline.py::test_a_quick_test"


def test_a_quick_test():
    assert TESTS.name == "tests"


def _pytest(deadline: float):
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", ORGANISM, QUICK]
    return subprocess.run(cmd, cwd=TESTS.parent, capture_output=True, text=True, timeout=300,
                          env=subprocess_env(TETHER_TEST_DEADLINE=str(deadline)))


def test_a_test_expected_to_end_past_the_deadline_is_skipped_and_says_so():
    p = _pytest(time.time() + 10 * 60)  # 10 minutes left: the organism run (22) does not fit, a quick test does
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 passed, 1 skipped" in p.stdout, p.stdout[-3000:]
    assert "expected to take 22 min" in p.stdout and "run it alone: bash scripts/test.sh " + ORGANISM in p.stdout


def test_past_the_deadline_every_test_is_skipped():
    p = _pytest(time.time() - 1)
    assert p.returncode == 0 and "2 skipped" in p.stdout, p.stdout[-3000:]
    assert "expected to take 0 min, 0.0 min left" in p.stdout, p.stdout[-3000:]
