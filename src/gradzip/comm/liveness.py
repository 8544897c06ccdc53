"""Which peer was lost? Heartbeats in the c10d store, read after a collective fails.

Gloo's own error does not say which rank went away, so each process runs a heartbeat: a
daemon thread that every ``HEARTBEAT_S`` writes ``hb/<rank>`` (a beat counter, the time,
how many collectives it has issued on each group, and whether it failed or left) to the
group's c10d store, on a connection of its own. On a failure, :meth:`Heartbeat.diagnose`
reads the peers' heartbeats (never on the hot path: only after a collective failed) and
blames

* a peer whose process is gone (peers on this machine: checked by pid at once);
* a peer whose heartbeat stopped for ``STALE_S`` (other machines);
* a peer that reported it failed or left the group;
* a peer that is alive but has not started this collective (stuck);

and says so when the store itself is unreachable (its host, rank 0 or the launcher, is
gone). Under torchrun the keys carry ``TORCHELASTIC_RESTART_COUNT``, so an earlier
attempt's heartbeats are never read. The heartbeat stops by itself once the process group
is destroyed, and at interpreter exit.

**At start-up** there is no heartbeat yet: a peer that never completes the rendezvous
(``init_process_group``) is found from the records each process writes to the store as it
reaches the rendezvous (:func:`announce_start`) and, under ``run_processes``, the pids its
launcher records (:func:`record_launch`): :func:`startup_verdict` names the ranks missing,
and whether each one's process is gone, stopped (SIGSTOP) or still starting.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..errors import first_line
from .base import PeerFailure, ranks_text

#: Seconds between two heartbeats of a process.
HEARTBEAT_S = 0.5
#: A peer whose heartbeat did not advance for this many seconds is taken for gone.
STALE_S = 3.0
#: Heartbeat store operations give up after this many seconds (store host unreachable).
STORE_TIMEOUT_S = 5.0


def announce_failure(exc: BaseException) -> None:
    """Tell the peers (through the heartbeat) that this process failed with ``exc``, so a
    peer whose collective breaks when this process leaves blames it by name. Call it when
    a worker is about to exit on an error (``run_processes`` does); harmless otherwise."""
    hb = Heartbeat.current
    if hb is not None and not isinstance(exc, PeerFailure):
        hb.announce("failed", f"{type(exc).__name__}: {exc}"[:300], ())



# -- collective sequence numbers ---------------------------------------------------------
class _Sequence:
    """Collectives issued by this process on one process group (shared by its handles)."""

    __slots__ = ("issued", "kind", "began")

    def __init__(self) -> None:
        self.issued = 0
        self.kind = ""
        self.began = 0.0

    def next(self, kind: str) -> int:
        seq = self.issued
        self.kind, self.began, self.issued = kind, time.time(), seq + 1
        return seq


_sequences: dict[str, _Sequence] = {}
_sequences_lock = threading.Lock()


def sequence(name: str) -> _Sequence:
    with _sequences_lock:
        return _sequences.setdefault(name, _Sequence())


# -- heartbeat ---------------------------------------------------------------------------
@dataclass
class Verdict:
    text: str
    lost: tuple[int, ...]


def _host_key() -> str | None:
    """Processes with the same key can check each other's pids (same host, boot and pid
    namespace); None where that cannot be told."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}/{ns}"


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` on this host has ended: it does not exist, or it is a zombie
    (killed, not yet reaped by its parent). A process of another user counts as alive."""
    return process_state(pid) == "gone"


def process_state(pid: int) -> str:
    """``"gone"`` (process ``pid`` of this host does not exist, or is a zombie: killed, not
    yet reaped by its parent), ``"stopped"`` (by SIGSTOP / SIGTSTP, or a debugger) or
    ``"alive"`` (also a process of another user, or where ``/proc`` cannot tell)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "alive"
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return "alive"
    return "gone" if state in ("Z", "X", "x") else "stopped" if state in ("T", "t") else "alive"


def _identity() -> dict:
    """This process as its peers see it: pid, host key (:func:`_host_key`), host name."""
    return {"pid": os.getpid(), "host": _host_key(), "hostname": socket.gethostname()}


def attempt_prefix() -> str:
    """The store prefix of this attempt's keys (rendezvous, start records, heartbeats):
    under torchrun one per restart (``TORCHELASTIC_RESTART_COUNT``), so an earlier attempt's
    keys are never read."""
    return f"gradzip/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _client(base, prefix: str):
    """A connection of its own to ``base``'s store, whose operations give up after
    :data:`STORE_TIMEOUT_S`, under ``prefix``."""
    store = base.clone()
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    return dist.PrefixStore(prefix, store)


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _store_on_rank0() -> bool:
    """Whether rank 0 hosts the store (env:// rendezvous), not a launcher (torchrun's agent,
    ``run_processes``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


class Heartbeat:
    """This process's heartbeat thread and its view of the peers' heartbeats."""

    current: "Heartbeat | None" = None
    _world: "weakref.ref | None" = None  # the default group it was made for (weakly)
    _lock = threading.Lock()
    _atexit = False

    @classmethod
    def ensure(cls) -> "Heartbeat | None":
        """The heartbeat of the current default group, started on its first handle."""
        with cls._lock:
            world = dist.group.WORLD
            if cls._world is not None and cls._world() is world:
                return cls.current
            if cls.current is not None:
                cls.current.stop()
            cls.current, cls._world = None, weakref.ref(world)
            with _sequences_lock:
                _sequences.clear()
            if dist.get_world_size() == 1:
                return None
            try:
                cls.current = Heartbeat(world)
            except Exception:  # noqa: BLE001 - no clonable store (FileStore, ...): no names
                return None
            if not cls._atexit:
                atexit.register(lambda: cls.current is not None and cls.current.stop())
                cls._atexit = True
            return cls.current

    def __init__(self, pg) -> None:
        self._pg = weakref.ref(pg)  # no strong reference: destroy_process_group must free it
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        base = dist.distributed_c10d._get_default_store()
        self.store = _client(base, attempt_prefix())  # the heartbeat's own connection
        self.probe = _client(base, attempt_prefix())  # diagnosis reads on another one
        self.store_error: str | None = None
        self.infos: dict[int, dict] = {}
        self.host = _host_key()
        self.state, self.why, self.lost = "running", "", ()
        self.beat = 0
        self._io = threading.Lock()
        self._diagnosing = threading.Lock()
        self._kick = threading.Event()
        self._stopping = threading.Event()
        self.store.set(f"info/{self.rank}", json.dumps(_identity()))
        self._publish()
        self.thread = threading.Thread(target=self._loop, name="gradzip-heartbeat", daemon=True)
        self.thread.start()

    # -- writing -------------------------------------------------------------------------
    def _publish(self) -> None:
        with _sequences_lock:
            issued = {name: [s.issued, s.kind, s.began] for name, s in _sequences.items()}
        value = json.dumps({"beat": self.beat, "t": time.time(), "state": self.state, "why": self.why,
                            "lost": list(self.lost), "issued": issued})
        with self._io:
            if self.store_error is None:
                try:
                    self.store.set(f"hb/{self.rank}", value)
                except Exception as exc:  # noqa: BLE001 - the store host is gone: stop writing
                    self.store_error = first_line(exc)
        self.beat += 1

    def announce(self, state: str, why: str, lost) -> None:
        """Publish a state change (``failed``, ``left``) at once."""
        if self.state == "running" or state == "left":
            self.state = state
        if not self.why:
            self.why, self.lost = why[:300], tuple(lost)
        self._publish()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._kick.wait(HEARTBEAT_S)
            self._kick.clear()
            if self._stopping.is_set() or not dist.is_initialized() or dist.group.WORLD is not self._pg():
                break
            self._publish()
            if self.store_error is None and len(self.infos) < self.world_size - 1:
                try:  # the peers' pids, for an instant diagnosis of those on this machine
                    with self._io:
                        self._read_infos(self.store, range(self.world_size))
                except Exception as exc:  # noqa: BLE001 - the store host is gone: stop
                    self.store_error = first_line(exc)
            if self.store_error is not None:
                return
        # "left" tells peers still in the group; once the group is destroyed its store's host
        # may be going away, and a store call then could outlive the interpreter's exit
        if self.store_error is None and dist.is_initialized() and dist.group.WORLD is self._pg():
            self.announce("left", "", ())

    def stop(self) -> None:
        self._stopping.set()
        self._kick.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)
        if Heartbeat.current is self:
            Heartbeat.current = None

    def _read_infos(self, store, ranks) -> None:
        self.infos.update(_records(store, "info", [r for r in ranks if r != self.rank and r not in self.infos]))

    # -- reading -------------------------------------------------------------------------
    def diagnose(self, peers: list[int], group: str, seq: int) -> Verdict:
        """Who among ``peers`` is to blame for the failure of collective ``seq`` on ``group``."""
        with self._diagnosing:
            return self._diagnose(peers, group, seq)

    def _diagnose(self, peers, group, seq) -> Verdict:
        started = time.monotonic()
        first: dict[int, int] = {}
        seen: dict[int, dict] = {}
        advanced: set[int] = set()
        store_error = self.store_error
        while True:
            # pids first: a peer announces its failure before it exits, so a peer found gone
            # here without an announcement below died without a word
            gone = [r for r in peers if self._local(r) and process_gone(self.infos[r]["pid"])]
            if 0 in gone and _store_on_rank0():
                store_error = self.store_error = "its host, rank 0, is gone"  # no use asking it
            if store_error is None:
                try:
                    self._read_infos(self.probe, peers)
                    present = [r for r in peers if r in seen] + _present(
                        self.probe, "hb", [r for r in peers if r not in seen])
                    if present:
                        for r, v in zip(present, self.probe.multi_get([f"hb/{r}" for r in present])):
                            seen[r] = json.loads(v)
                except Exception as exc:  # noqa: BLE001 - the store host is gone
                    store_error = first_line(exc)
            for r, value in seen.items():
                if first.setdefault(r, value["beat"]) != value["beat"]:
                    advanced.add(r)
            reported = {r for r in peers if seen.get(r, {}).get("state") in ("failed", "left")}
            dead = [r for r in gone if r not in reported]
            if store_error is not None:
                self.store_error = self.store_error or store_error  # the heartbeat stops writing
            unresolved = [r for r in peers if r not in advanced and r not in reported and r not in dead]
            waited = time.monotonic() - started
            # silent: no beat while we watched for STALE_S, or (same clock) none for as long
            silent = [r for r in unresolved if waited >= STALE_S or (
                self._local(r) and r in seen and time.time() - seen[r]["t"] >= STALE_S)]
            if dead or store_error is not None or len(silent) == len(unresolved):
                break
            time.sleep(0.2)
        return self._verdict(peers, group, seq, seen, dead, reported, silent, store_error)

    def _local(self, rank: int) -> bool:
        info = self.infos.get(rank)
        return info is not None and self.host is not None and info.get("host") == self.host

    def _verdict(self, peers, group, seq, seen, dead, reported, silent, store_error) -> Verdict:
        now = time.time()

        def last_beat(r):
            return f"; last heartbeat {now - seen[r]['t']:.1f} s ago" if r in seen else ""

        parts, lost = [], []
        store_went = store_error is not None and _store_on_rank0() and 0 in dead
        for r in dead:
            also = f", and with it the c10d store it hosted at {_store_address()}" if r == 0 and store_went else ""
            parts.append(f"peer rank {r} is gone (its process {self.infos[r]['pid']} exited{last_beat(r)}{also})")
            lost.append(r)
        if store_error is not None and not store_went:
            host = "rank 0" if _store_on_rank0() else "the launcher (torchrun's agent or run_processes)"
            parts.append(f"the c10d store at {_store_address()} is unreachable ({store_error}): "
                         f"its host, {host}, is probably gone")
            if not lost and _store_on_rank0():
                lost.append(0)
        else:  # heartbeats that stopped
            for r in silent:
                if r not in seen:
                    parts.append(f"peer rank {r} is gone (it never sent a heartbeat)")
                elif self._local(r):
                    parts.append(f"peer rank {r} is unresponsive (its process {self.infos[r]['pid']} is alive "
                                 f"but its heartbeat stopped {now - seen[r]['t']:.1f} s ago)")
                else:
                    parts.append(f"peer rank {r} is gone (its heartbeat stopped {now - seen[r]['t']:.1f} s ago)")
                lost.append(r)
        if not parts:  # peers that failed on their own, or left
            for r in sorted(reported):
                value = seen[r]
                if value["lost"]:
                    continue  # it gave up on someone else: a victim, not a cause
                if value["state"] == "failed":
                    parts.append(f"peer rank {r} failed ({value['why']})")
                elif value["why"]:
                    parts.append(f"peer rank {r} failed ({value['why']}) and left the group")
                else:
                    parts.append(f"peer rank {r} left the group (it closed its process group)")
                lost.append(r)
        if not parts:  # a peer that is alive but has not started this collective
            for r in peers:
                issued, kind, began = seen.get(r, {}).get("issued", {}).get(group, [0, "", 0.0])
                if issued <= seq and r not in reported:
                    last = (f"its last one, {kind} #{issued - 1}, began {now - began:.1f} s ago"
                            if issued else "it has not started any collective on this group")
                    parts.append(f"peer rank {r} is alive but stuck: it has not started this collective ({last})")
                    lost.append(r)
        if not parts:
            blamed = sorted({b for r in reported for b in seen[r]["lost"]} - {self.rank})
            if blamed:
                by = ", ".join(str(r) for r in sorted(reported) if seen[r]["lost"])
                parts.append(f"peer {ranks_text(blamed)} lost, as reported by rank(s) {by}")
                lost.extend(blamed)
            elif reported:
                parts.append(f"peer {ranks_text(reported)} gave up on this collective ("
                             + "; ".join(seen[r]["why"] for r in sorted(reported)) + ")")
                lost.extend(sorted(reported))
            else:
                parts.append("every peer is alive and has started this collective, yet it failed: "
                             "the connection between them broke or stalled")
        return Verdict("; ".join(parts), tuple(dict.fromkeys(lost)))


def _present(store, kind: str, ranks: list[int]) -> list[int]:
    """Those of ``ranks`` whose key ``kind/<rank>`` exists (one round trip when all do)."""
    if not ranks or store.check([f"{kind}/{r}" for r in ranks]):
        return ranks
    return [r for r in ranks if store.check([f"{kind}/{r}"])]


def _records(store, kind: str, ranks: list[int]) -> dict[int, dict]:
    """``{rank: record}`` for those of ``ranks`` whose JSON record ``kind/<rank>`` exists."""
    present = _present(store, kind, ranks)
    values = store.multi_get([f"{kind}/{r}" for r in present]) if present else []
    return {r: json.loads(v) for r, v in zip(present, values)}


# -- start-up ----------------------------------------------------------------------------
def announce_start(base, rank: int) -> None:
    """Record in the rendezvous store ``base`` that this process, rank ``rank``, reached the
    rendezvous (its pid and host): call it just before ``init_process_group``."""
    dist.PrefixStore(attempt_prefix(), base).set(f"start/{rank}", json.dumps(_identity()))


def record_launch(base, rank: int, pid: int) -> None:
    """Record in the store ``base`` a launcher hosts that it started process ``pid`` as rank
    ``rank`` (``run_processes``): its peers can then tell what became of it if it never
    reaches the rendezvous."""
    dist.PrefixStore(attempt_prefix(), base).set(f"launched/{rank}", json.dumps({"pid": pid, "host": _host_key()}))


#: What a peer's process state says of it at start-up (:func:`startup_verdict`).
_STARTUP_STATE = {"gone": "exited", "stopped": "is stopped (SIGSTOP or a debugger)",
                  "alive": "is alive but still starting up (importing, loading data)"}


def startup_verdict(base, rank: int, world_size: int) -> Verdict:
    """Which peers kept rank ``rank``'s process group from forming at start-up, and what each
    was doing, read from the store ``base`` after ``init_process_group`` failed (None: this
    process could not connect to the store). A peer that never reached the rendezvous (no
    :func:`announce_start`) is blamed, with its process's state where its launcher recorded
    its pid (:func:`record_launch`) on this host; one that reached it, only where its process
    (on this host) has exited or is stopped."""
    peers = [r for r in range(world_size) if r != rank]
    try:
        if base is None:
            raise ConnectionError("it did not answer")
        store = _client(base, attempt_prefix())
        arrived = _records(store, "start", peers)
        launched = _records(store, "launched", [r for r in peers if r not in arrived])
    except Exception as exc:  # noqa: BLE001 - the store's host is gone, stopped or not started yet
        host = "rank 0" if _store_on_rank0() else "the launcher (torchrun's agent or run_processes)"
        return Verdict(f"the c10d store at {_store_address()} is unreachable ({first_line(exc)}): its host, "
                       f"{host}, is gone, stopped or still starting", (0,) if _store_on_rank0() and rank != 0 else ())
    here = _host_key()

    def state(info: dict) -> str | None:
        return process_state(info["pid"]) if here is not None and info.get("host") == here else None

    parts, lost = [], []
    for r in peers:
        if r in arrived:
            now = state(arrived[r])
            if now in ("gone", "stopped"):
                parts.append(f"peer rank {r} {_STARTUP_STATE[now]} in the rendezvous (its process {arrived[r]['pid']})")
                lost.append(r)
            continue
        now = state(launched[r]) if r in launched else None
        if now is None:
            parts.append(f"peer rank {r} never reached the rendezvous (no word from it: it is still starting, "
                         "stopped or gone)")
        else:
            parts.append(f"peer rank {r} {_STARTUP_STATE[now]}: it never reached the rendezvous "
                         f"(its process {launched[r]['pid']})")
        lost.append(r)
    if not parts:
        parts.append("every peer reached the rendezvous and is alive, yet the connection between them failed")
    return Verdict("; ".join(parts), tuple(lost))



