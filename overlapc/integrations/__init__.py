"""Adapters that put overlapc into other frameworks' compile pipelines
(``overlapc.integrations.torchtitan``: torchtitan's graph_trainer). Each is
imported on its own; none imports its framework until asked to register.

May import: the public names (``overlapc``), ``overlapc.torch_compat`` and
``overlapc.passes``; only the command line imports it."""
