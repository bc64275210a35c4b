"""Requests, sampling parameters, the scheduler and the engine loop."""
