"""Requests, sampling parameters and the scheduler: the floor between the KV cache manager
and the worker."""
