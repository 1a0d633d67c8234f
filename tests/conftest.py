"""Hypothesis profiles: `ci` (default) is derandomized and bounded; `deep` explores far more.

Select with EPD_RING_HYPOTHESIS=deep (or ci).
"""

from __future__ import annotations

import logging
import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, database=None, deadline=None, max_examples=60, stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.register_profile(
    "deep", deadline=None, max_examples=2000, stateful_step_count=150,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.load_profile(os.environ.get("EPD_RING_HYPOTHESIS", "ci"))

# Injected faults log errors on purpose; keep test output readable.
logging.getLogger("epd_ring").setLevel(logging.CRITICAL)
