"""Benchmarks: the emulated cluster network and the timeline model.

- :mod:`gradzip.bench.netns`: N worker network namespaces behind a "switch", every link
  shaped with ``tc`` (needs root).
- :mod:`gradzip.bench.net`: ``gradzip bench net``, real gloo workers on that network,
  the shaping check first, then the time per iteration and its breakdown per method.
- :mod:`gradzip.bench.model`: ``gradzip bench model``, an alpha-beta event model of one
  iteration per method, validated against ``bench net`` and projected to large clusters.
"""
