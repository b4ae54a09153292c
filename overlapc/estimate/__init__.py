"""Estimates: what a schedule costs, before it runs.

Owns the cost model (``costmodel``: device and link profiles, per-node and
per-collective times, profile files) and the simulator (``simulate``: a
timeline of compute and collectives on their streams, exposed communication,
peak memory).

May import: ``overlapc.passes``, ``overlapc.collectives``, ``overlapc.config``.
Never the compile path, the explanations, calibration or the command line.

The names below are the interface the compile path (``overlapc.api``,
``overlapc.backend``) reads the estimator through; the explanations and
calibration use the modules themselves.
"""
from overlapc.estimate.costmodel import (
    CPU_DEFAULT, DEFAULT, Profile, default_for, profile_from_text, profile_to_text, resolve,
)

__all__ = ["CPU_DEFAULT", "DEFAULT", "Profile", "default_for", "profile_from_text", "profile_to_text", "resolve"]
