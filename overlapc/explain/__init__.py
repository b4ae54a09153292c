"""Explanations: what a schedule did and why, predicted and measured.

``report`` (per-collective rows, the summary, the dump folder's files),
``html_report`` (one self-contained HTML page), ``analyze`` (a profiler
trace matched to a dump: each collective's measured exposure beside its
estimate).

May import: ``overlapc.passes``, the core modules (``config``,
``collectives``) and ``overlapc.estimate``. Never the compile path,
calibration or the command line: whoever captured the graphs hands them in.
"""
