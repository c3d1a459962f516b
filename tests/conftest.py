"""Test settings shared by the suite: one hypothesis profile, reproducible in CI."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "s2hc",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # CI failures must reproduce
)
settings.load_profile("s2hc")
