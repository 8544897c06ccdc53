"""Benchmarks: the emulated cluster network and the timeline model. Every module returns
data (dicts, dataclasses); ``gradzip bench`` prints it, ``benchmarks/network.py`` writes it
into the pages of docs/benchmarks/ with plots.

Imports point down this list:

- :mod:`~gradzip.bench.units`: rates and comma lists as the flags take and show them.
- :mod:`~gradzip.bench.netns`: N worker network namespaces behind a "switch", every link
  shaped with ``tc`` (needs root).
- :mod:`~gradzip.bench.emulated`: real gloo workers on that network: the shaping check,
  then the time per iteration and its breakdown per method (``gradzip bench net``).
- :mod:`~gradzip.bench.costs`: the alpha-beta cost of ring collectives.
- :mod:`~gradzip.bench.profiling`: a method's collectives and codec times per step, from
  running its ``step()`` on a recording group.
- :mod:`~gradzip.bench.shapes`: parameter shapes (ResNet-50, harness models).
- :mod:`~gradzip.bench.timeline`: the event model of one iteration, validated against the
  emulated runs and projected to large clusters (``gradzip bench model``).
- :mod:`~gradzip.bench.tables`: the markdown tables the command prints.
- :mod:`~gradzip.bench.cli`: the ``gradzip bench`` argument parsing.
"""
