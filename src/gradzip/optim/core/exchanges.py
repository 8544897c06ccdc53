"""The exchanges a method owns: a mixin of
:class:`~gradzip.optim.core.base.DistributedOptimizer`, apart from it because it is one
concept (building each PSync a method's box uses, with the run's transport, hierarchy,
seeds and tracer; and accounting for all of them) that no box reads.

The host class provides ``comm``, ``seed``, ``bucket_bytes``, ``nonfinite``,
``transport``, ``round_bytes``, ``_declared_link``, ``recalibrate_every``, ``_hierarchy``,
``reads_packets``, ``steps``, ``param_groups``, ``_keys``, ``_all_params()`` and the lists
``_exchanges`` and ``_names``.
"""
from __future__ import annotations

from ... import comm as comm_lib
from ... import seeds
from ...compressors import Compressor
from ...exchange import Plan, PSync, Timings
from ...exchange.hierarchy import HierarchicalPSync
from ...trace import forwarding_tracer


class ExchangeOwner:
    """Mixin: the method's PSync exchanges, their tracer and their accounting."""

    _tracer = None

    def _learn_names(self) -> None:
        """Parameter names of named param groups (``Method(model.named_parameters(), ...)``,
        torch's ``param_names``) by key: what a PerTensor policy's name rules match."""
        for g in self.param_groups:
            for p, n in zip(g["params"], g.get("param_names", ())):
                self._names[self._keys[p]] = n

    def make_psync(self, compressor: "str | Compressor | None", salt: int = 0,
                   comm: "comm_lib.Group | None" = None, transport: str | None = None) -> PSync:
        """A PSync on this optimizer's group (or ``comm``); ``salt`` separates the seeds of
        two exchanges; ``transport``: this exchange's own (e.g. ``"twophase"`` for a
        method whose box says so), else the optimizer's ``transport``; with
        ``hierarchy`` > 1 a :class:`~gradzip.exchange.hierarchy.HierarchicalPSync` (the transport
        applies to its exchange across nodes)."""
        common = dict(seed=seeds.exchange_seed(self.seed, salt), bucket_bytes=self.bucket_bytes,
                      check_finite=self.nonfinite != "off", transport=transport or self.transport,
                      allow_twophase=not self.reads_packets, round_bytes=self.round_bytes, link=self._declared_link,
                      recalibrate_every=self.recalibrate_every)
        if self._hierarchy > 1:
            psync = HierarchicalPSync(comm or self.comm, compressor, workers_per_node=self._hierarchy, **common)
        else:
            psync = PSync(comm or self.comm, compressor, **common)
        psync.tracer = self._tracer
        psync.names = self._names   # shared: names of groups added later reach it too
        self._exchanges.append(psync)
        return psync

    tracer = forwarding_tracer(lambda self: self._exchanges)   # a Tracer its exchanges record into

    def exchange_plans(self) -> dict[str, "Plan"]:
        """Per exchange, its plan over every parameter that takes part
        (:meth:`PSync.exchange_plan`, :func:`gradzip.exchange.plan`): the same on every worker."""
        params = [p for p in self._all_params() if p.requires_grad]
        keys = self.keys(params)
        return {f"exchange {i}": x.exchange_plan(params, keys)[1] for i, x in enumerate(self._exchanges)}

    def describe_plan(self) -> str:
        """The plans as text, a line per bucket (``print(opt.describe_plan())``)."""
        return "\n".join(f"{name} ({psync.compressor.spec}):\n  " + "\n  ".join(p.describe())
                         for (name, p), psync in zip(self.exchange_plans().items(), self._exchanges))

    def auto_decisions(self) -> dict[str, str]:
        """Per auto:<codec> exchange, its decisions in one line (``PSync.describe_decisions``):
        the run's summary (``auto``)."""
        return {f"exchange {i}": x.describe_decisions() for i, x in enumerate(self._exchanges)
                if x.describe_decisions() is not None}

    def auto_links(self) -> dict[str, list[float]]:
        """Per auto:<codec> exchange, the link (bytes/s, latency s) of its latest decision:
        the run's summary (``auto_link``; the projection profiles the run's own decision
        on it)."""
        out = {}
        for i, x in enumerate(self._exchanges):
            latest = max(x.decisions.values(), key=lambda d: d.step, default=None)
            if latest is not None:
                out[f"exchange {i}"] = [latest.link.bytes_per_s, latest.link.latency_s]
        return out

    def auto_choices(self) -> list[str]:
        """The codec every unit of every auto:<codec> decision took (``"none"``: uncompressed),
        exchange by exchange: how many units auto compresses (the projections count them)."""
        return [c for x in self._exchanges for d in x.decisions.values() for c in d.choices]

    def transports(self) -> dict[str, str]:
        """Per exchange, its ``transport`` setting and the transport it takes for each
        parameter tensor (``PSync.routes``, the same on every worker), e.g.
        ``{"exchange 0": "auto: twophase,allreduce"}``: compared across workers, reported
        in the run's summary."""
        params = [p for p in self._all_params() if p.requires_grad]
        keys = self.keys(params)
        return {f"exchange {i}": f"{x.transport}: " + ",".join(x.routes(params, keys))
                for i, x in enumerate(self._exchanges)}

    # -- accounting --------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Bytes this worker put on the wire in this optimizer's exchanges."""
        return sum(x.bytes_sent for x in self._exchanges)

    @property
    def compression_ratio(self) -> float:
        """R_C: payload bytes S-SGD would have sent in as many steps (every gradient, dense)
        / payload bytes this worker's packets carried (1 for S-SGD; inf if none sent)."""
        payload = sum(x.payload_bytes for x in self._exchanges)
        dense = self.steps * sum(p.numel() * p.element_size() for g in self.param_groups for p in g["params"])
        return dense / payload if payload else float("inf")

    @property
    def timings(self) -> Timings:
        """Codec and communication time of this method's exchanges (see
        :class:`~gradzip.exchange.Timings`); a method that waits for a background exchange
        outside PSync adds that wait to ``wait_s`` by overriding this."""
        return sum((x.timings for x in self._exchanges), Timings())
