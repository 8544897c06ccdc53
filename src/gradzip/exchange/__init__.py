"""The exchange layer: how a method's tensors cross the wire (docs/algorithms.md §PSync,
§Transports). Its centre is the plan (:mod:`.planner`): a pure function from shapes, codec,
world size, bucket size, transport, hierarchy and link to buckets, routes and costs. PSync
(:mod:`.psync`) executes a plan; the two-phase compressed allreduce (:mod:`.twophase`) and
the hierarchical exchange (:mod:`.hierarchy`) are routes of it.
"""
from .planner import (DEFAULT_BUCKET_BYTES, DEFAULT_LINK, TRANSPORTS, Bucket, Link, Plan, as_link,
                      check_transport, plan)
from .psync import Pending, PSync, Result, Timings, mix_seed

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_LINK", "TRANSPORTS", "Bucket", "Link", "Plan", "Pending", "PSync",
           "Result", "Timings", "as_link", "check_transport", "mix_seed", "plan"]
