"""Hypothesis profiles for tests/kv.

The default stays fast (CI runs it). `python -m pytest tests/kv --hypothesis-profile=long`
runs the state machine of test_oracle.py for well over 1e5 steps in total and prints how many
it ran.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "long", max_examples=4000, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    from tests.kv.test_oracle import ManagerMachine

    if ManagerMachine.num_runs:
        terminalreporter.write_line(
            f"kv state machine: {ManagerMachine.num_runs} runs, "
            f"{ManagerMachine.num_steps} steps (rules run)")
