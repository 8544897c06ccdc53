"""An emulated cluster network: one Linux network namespace per worker, a "switch".

``Topology(n, bandwidth_bps, latency_s)`` as a context manager builds::

    <prefix>-w0 [gz0 198.18.0.1] ══veth══ [p0]┐
    <prefix>-w1 [gz0 198.18.0.2] ══veth══ [p1]┼─ br0 in <prefix>-sw (the switch)
    ...                                       ┘

and shapes *every* link in *both* directions with ``tc``: on the worker's end (its
upload) and on the switch's end (its download), a ``tbf`` of the given rate, with a
``netem`` delay of half the one-way latency below it when a latency is asked for. So each
worker has a link of its own, as in a cluster: a ring collective's steps run in parallel
on separate links (shaping one shared loopback would cap the *sum* of all workers'
traffic instead). Addresses come from 198.18.0.0/15 (RFC 2544, reserved for
network benchmarks) and exist only inside these namespaces; nothing is created in the
namespace this process runs in.

With ``workers_per_node=k`` > 1 the workers sit in nodes of k (ranks node-major): each
worker's veth goes to a bridge in its node's namespace ``<prefix>-n<m>`` (unshaped: the
fast links inside a node) and each node has one uplink to the switch, shaped as above::

    w0, w1 ══ nb0 in <prefix>-n0 ══[up0]══ [u0]┐
    w2, w3 ══ nb0 in <prefix>-n1 ══[up0]══ [u1]┴─ br0 in <prefix>-sw

Every namespace (and with it every veth, the bridge and the qdiscs) is removed on exit
from the ``with`` block, also on an exception, Ctrl-C (SIGINT) or SIGTERM; namespaces
left behind by a run that was killed outright (SIGKILL) are removed by the next run
(:func:`remove_stale`). Names carry the creating process's pid and a random tag, so
concurrent runs never collide. Needs root and the ``ip`` and ``tc`` programs; without
them it raises :class:`~gradzip.errors.GradzipError` and changes nothing.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field

from ..comm.liveness import process_gone
from ..errors import GradzipError
from ..validation import is_int

#: Every namespace this module makes is named ``gzb<pid>x<tag>-...``.
PREFIX = "gzb"
#: The worker's interface, inside its own namespace.
IFNAME = "gz0"
SUBNET_PREFIXLEN = 15


def address(rank: int) -> str:
    """Worker ``rank``'s address in 198.18.0.0/15 (198.18.0.1, 198.18.0.2, ...)."""
    if not 0 <= rank < 250 * 512:
        raise GradzipError(f"worker rank must be in [0, {250 * 512}), got {rank}")
    hi, lo = divmod(rank, 250)
    return f"198.{18 + hi // 256}.{hi % 256}.{lo + 1}"


def check_available() -> None:
    """Raise :class:`GradzipError` unless this process can build namespaces and shape them."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise GradzipError(f"the network emulator needs the {' and '.join(missing)} program(s) "
                           f"(package iproute2); not found on PATH")
    if os.geteuid() != 0:
        raise GradzipError("the network emulator needs root (network namespaces and tc); "
                           "run as root, or use `gradzip bench model` which needs neither")


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise GradzipError(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def list_namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete the namespaces of emulator runs whose process no longer exists or is a zombie
    (a run killed with SIGKILL cannot clean up after itself); returns their names."""
    removed = []
    for name in list_namespaces():
        if not name.startswith(PREFIX) or "x" not in name:
            continue
        pid = name[len(PREFIX):].split("x", 1)[0]
        if pid.isdigit() and process_gone(int(pid)):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            removed.append(name)
    return removed


def shape_commands(namespace: str, dev: str, rate_bps: float, delay_s: float) -> list[list[str]]:
    """The ``tc`` commands that shape ``dev``'s egress: tbf at ``rate_bps`` (bits/s), with
    a netem delay of ``delay_s`` below it when positive. The bucket holds 1 ms of traffic
    (at least 64 KiB, so a full-size segment always fits) and the queue 50 ms (at least
    1 MiB), so TCP is paced, not dropped."""
    rate_Bps = rate_bps / 8
    burst = max(64 << 10, int(rate_Bps * 1e-3))
    limit = max(1 << 20, int(rate_Bps * 0.05))
    tc = ["tc", "-n", namespace, "qdisc", "add", "dev", dev]
    cmds = [tc + ["root", "handle", "1:", "tbf", "rate", f"{int(rate_bps)}bit",
                  "burst", str(burst), "limit", str(limit)]]
    if delay_s > 0:
        cmds.append(tc + ["parent", "1:1", "handle", "10:", "netem", "delay", f"{delay_s * 1e6:.0f}us",
                          "limit", "100000"])
    return cmds


@dataclass
class Topology:
    """``n`` worker namespaces behind a switch; links of ``bandwidth_bps`` bits/s each way
    (None: unshaped) and a one-way worker-to-worker ``latency_s`` (half on each link)."""

    n: int
    bandwidth_bps: float | None = None
    latency_s: float = 0.0
    workers_per_node: int = 1
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}")
    created: list[str] = field(default_factory=list, init=False)
    _old_handlers: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if not is_int(self.n) or self.n < 1:
            raise GradzipError(f"the emulated network needs >= 1 worker, got {self.n!r}")
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise GradzipError(f"link bandwidth must be > 0 bit/s, got {self.bandwidth_bps!r}")
        if not self.latency_s >= 0:
            raise GradzipError(f"latency must be >= 0 s, got {self.latency_s!r}")
        k = self.workers_per_node
        if not is_int(k) or k < 1 or self.n % k:
            raise GradzipError(f"workers per node must be an integer >= 1 dividing the {self.n} workers, got {k!r}")

    # -- names ---------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def worker(self, rank: int) -> str:
        """The namespace of worker ``rank``."""
        return f"{self.prefix}-w{rank}"

    def node(self, m: int) -> str:
        """The namespace of node ``m``'s bridge (``workers_per_node`` > 1)."""
        return f"{self.prefix}-n{m}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Prefix a command with this to run it inside worker ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.worker(rank)]

    # -- life cycle ----------------------------------------------------------------------
    def __enter__(self) -> "Topology":
        check_available()
        remove_stale()
        self._trap_signals()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _trap_signals(self) -> None:
        """While the namespaces exist, SIGINT raises KeyboardInterrupt and SIGTERM / SIGHUP
        SystemExit, so ``finally`` blocks and ``__exit__`` run and remove them. SIGINT is
        trapped too because a process started in the background by a non-interactive shell
        (or under nohup) inherits it *ignored*, and would then keep its namespaces on Ctrl-C
        or ``kill -INT``. The previous handlers come back in :meth:`close`. Only possible
        from the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return

        def raise_exit(signum, frame):
            raise SystemExit(128 + signum)

        self._old_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, raise_exit)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw = self.switch
        self._add_namespace(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        if self.latency_s > 0:
            self._check_netem()
        k = self.workers_per_node
        shaped = self.bandwidth_bps is not None or self.latency_s > 0
        rate = self.bandwidth_bps or 100e9
        if k > 1:   # one bridge per node; its uplink to the switch is the shaped link
            for m in range(self.n // k):
                node, uplink = self.node(m), f"u{m}"
                self._add_namespace(node)
                _run("ip", "-n", node, "link", "add", "nb0", "type", "bridge")
                _run("ip", "-n", node, "link", "set", "nb0", "up")
                _run("ip", "link", "add", "name", "up0", "netns", node, "type", "veth",
                     "peer", "name", uplink, "netns", sw)
                for namespace, dev, bridge in ((node, "up0", "nb0"), (sw, uplink, "br0")):
                    _run("ip", "-n", namespace, "link", "set", dev, "master", bridge)
                    _run("ip", "-n", namespace, "link", "set", dev, "up")
                    if shaped:
                        for cmd in shape_commands(namespace, dev, rate, self.latency_s / 2):
                            _run(*cmd)
        for rank in range(self.n):
            ns, port = self.worker(rank), f"p{rank}"
            hub, bridge = (sw, "br0") if k == 1 else (self.node(rank // k), "nb0")
            self._add_namespace(ns)
            # both ends are born in their namespaces: nothing appears in ours
            _run("ip", "link", "add", "name", IFNAME, "netns", ns, "type", "veth",
                 "peer", "name", port, "netns", hub)
            _run("ip", "-n", hub, "link", "set", port, "master", bridge)
            _run("ip", "-n", hub, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address(rank)}/{SUBNET_PREFIXLEN}", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            if shaped and k == 1:
                for namespace, dev in ((ns, IFNAME), (sw, port)):
                    for cmd in shape_commands(namespace, dev, rate, self.latency_s / 2):
                        _run(*cmd)

    def _check_netem(self) -> None:
        probe = ["tc", "-n", self.switch, "qdisc", "add", "dev", "br0", "root", "netem", "delay", "1ms"]
        proc = subprocess.run(probe, capture_output=True, text=True)
        if proc.returncode != 0:
            raise GradzipError(
                "a latency needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), which this kernel "
                f"lacks (`tc ... netem` said: {proc.stderr.strip()}); use latency 0 (bandwidth is "
                "shaped with tbf), or a kernel with sch_netem")
        subprocess.run(["tc", "-n", self.switch, "qdisc", "del", "dev", "br0", "root"], capture_output=True)

    def close(self) -> None:
        """Delete every namespace this topology made (their veths, bridge and qdiscs go with
        them); idempotent. Signal handlers are restored."""
        failures = []
        for name in reversed(self.created):
            proc = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True)
            if proc.returncode != 0 and name in list_namespaces():
                failures.append(f"{name}: {proc.stderr.strip()}")
        self.created.clear()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        if failures:
            raise GradzipError("could not remove network namespace(s): " + "; ".join(failures))

    def leftovers(self) -> list[str]:
        """Namespaces of this topology that still exist (empty after ``close()``)."""
        return [name for name in list_namespaces() if name.startswith(self.prefix)]
