"""The short pass and the long one: every `make test` runs the short pass of the fuzz tests (a quarter of their
examples, 16 random faults instead of 200) and of the soak scenarios (Redis stopped, not also frozen);
TANDEM_TEST_HEAVY=1, which .ci/run sets for its heavy suites when the run has time for them, runs the long pass
(LONG)."""
import os

from hypothesis import HealthCheck, settings

LONG = os.environ.get("TANDEM_TEST_HEAVY") == "1"


def fuzz_settings(max_examples: int) -> settings:
    """max_examples examples in the long pass, a quarter of them (at least 4) in the short one; derandomized, so
    every run draws the same examples, and without deadlines (a cluster round trip is slow on a loaded machine)."""
    return settings(max_examples=max_examples if LONG else max(4, max_examples // 4), deadline=None,
                    suppress_health_check=list(HealthCheck), derandomize=True)
