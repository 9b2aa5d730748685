"""The process world of one training run: DP x PP device mesh, process groups, backend, timeouts.

Rank layout is the mesh's row-major order: ``rank = dp_rank * pp_size + pp_rank``, so the stages of one
pipeline are consecutive ranks (on one node when ``pp_size`` divides the GPUs per node, which keeps the
heavy p2p traffic off the network) and each DP group holds one stage's replicas.

Every collective and p2p operation inherits ``timeout_s``: a peer that dies closes its sockets and the
others fail at once; a peer that hangs makes them fail after ``timeout_s``. Either way the error is turned
into a :class:`PeerFailure` that names the rank, its mesh coordinates and what it was doing.

``spawn_local`` starts the ranks of a single-node run as local processes (what ``omnibal train --nproc``
and the multi-process tests use); under ``torchrun`` the environment already holds RANK/WORLD_SIZE.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_mod
import signal as signal_mod
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from omnibal.errors import InputError, OmnibalError
from omnibal.train.heartbeat import Heartbeat
from omnibal.train.rank_exceptions import one_line, sendable

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from omnibal.train.heartbeat import Heartbeat


class PeerFailure(OmnibalError):
    """A collective or p2p operation failed or timed out: another rank died or stopped responding."""


def backend_for(device_type: str) -> str:
    """gloo on CPU, NCCL on CUDA."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "nccl"
    raise InputError(f"no process-group backend for device {device_type!r} (cpu or cuda)", source="device")


@dataclass(frozen=True)
class World:
    """This rank's place in the DP x PP mesh and the groups it talks on."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    device: torch.device
    backend: str
    timeout_s: float
    mesh: DeviceMesh | None
    """torch DeviceMesh with dims ("dp", "pp")."""
    dp_group: dist.ProcessGroup | None
    """Process group of this stage's replicas (gradient all-reduce)."""
    pp_group: dist.ProcessGroup | None
    """Process group of this DP rank's pipeline (activation p2p)."""
    heartbeat: Heartbeat | None = None
    """:class:`omnibal.train.heartbeat.Heartbeat` of a multi-process world (None: one process, or no store)."""

    @property
    def where(self) -> str:
        return f"rank {self.rank} (dp {self.dp_rank}/{self.dp_size}, pp {self.pp_rank}/{self.pp_size})"

    def where_rank(self, rank: int) -> str:
        """How :attr:`where` names another rank of this world."""
        return f"rank {rank} (dp {rank // self.pp_size}/{self.dp_size}, pp {rank % self.pp_size}/{self.pp_size})"

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_world(*, dp_size: int, pp_size: int, device: str = "cpu", timeout_s: float = 60.0) -> World:
    """Join the process group (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and build
    the ("dp", "pp") mesh. Fails with an InputError when the launched world does not match dp x pp."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise InputError(f"environment lacks {', '.join(missing)}: launch with torchrun or `omnibal train "
                         f"--nproc N`", source="environment")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != dp_size * pp_size:
        raise InputError(f"launched with {world_size} processes but dp {dp_size} x pp {pp_size} = "
                         f"{dp_size * pp_size}", source="WORLD_SIZE", field="dp_size/pp_size")
    backend = backend_for(device)
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        mesh = init_device_mesh(device, (dp_size, pp_size), mesh_dim_names=("dp", "pp"))
    except (RuntimeError, dist.DistError) as exc:  # rendezvous timeout, refused connection
        raise PeerFailure(f"rank {rank}: could not join the {world_size}-rank world at "
                          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout_s:g} s: "
                          f"{_first_line(exc)}") from exc
    coords = mesh.get_coordinate()
    assert coords is not None and coords[0] * pp_size + coords[1] == rank, (coords, rank)
    return World(rank=rank, world_size=world_size, dp_rank=coords[0], dp_size=dp_size, pp_rank=coords[1],
                 pp_size=pp_size, device=torch_device, backend=backend, timeout_s=timeout_s, mesh=mesh,
                 dp_group=mesh["dp"].get_group(), pp_group=mesh["pp"].get_group(),
                 heartbeat=_start_heartbeat(rank, world_size, timeout_s))


_HEARTBEATS: list = []


def _start_heartbeat(rank: int, world_size: int, timeout_s: float):
    """This rank's heartbeat (see :mod:`omnibal.train.heartbeat`); None when the store cannot take one."""
    if world_size == 1:
        return None

    try:
        beat = Heartbeat(rank, world_size, read_timeout_s=min(3.0, max(1.0, timeout_s / 2)))
    except Exception:  # a store without add(), an unreachable store: failures then name no peer, as before
        return None
    _HEARTBEATS.append(beat)
    return beat


def local_world(device: str = "cpu", timeout_s: float = 60.0) -> World:
    """A world of one process (dp 1 x pp 1) that needs no process group: `omnibal train` without --nproc,
    and single-process tests."""
    torch_device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return World(rank=0, world_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, device=torch_device,
                 backend=backend_for(device), timeout_s=timeout_s, mesh=None, dp_group=None, pp_group=None)


def destroy_world() -> None:
    while _HEARTBEATS:
        _HEARTBEATS.pop().stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def peer_failure(world: World, what: str, exc: BaseException) -> PeerFailure:
    """Turn a backend error (connection reset, timeout) into one message a user can act on, naming the peer
    whose heartbeat stopped when the heartbeats tell."""
    return PeerFailure(f"{world.where}: {what} failed: a peer rank died or stopped responding{_culprits(world)} "
                       f"(operations time out after {world.timeout_s:g} s; check the other ranks' logs): "
                       f"{_first_line(exc)}")


def _culprits(world: World) -> str:
    if world.heartbeat is None:
        return ""
    silent = world.heartbeat.silent_ranks()
    if silent is None:
        return (": the rendezvous store does not answer either, so its host stopped or died (rank 0, unless "
                "torchrun's agent hosts it)")
    if not silent:
        return ""
    return ": " + ", ".join(world.where_rank(r) for r in silent) + " stopped responding (no heartbeat)"


def is_comm_error(exc: BaseException) -> bool:
    """Whether an exception comes from the communication backend rather than from user code.

    A ``DistError`` is one by type. Gloo raises a plain ``RuntimeError`` when a peer dies (``Connection reset by
    peer``) or a collective times out (``Timed out waiting ...``), so those are told by the backend's words in
    the message (tests/test_distributed_errors.py pins both on the installed torch)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    markers = ("gloo", "Connection reset", "Connection closed", "Timed out", "NCCL", "timed out", "Broken pipe",
               "DistBackendError", "ProcessGroup")
    return isinstance(exc, RuntimeError) and any(m in text for m in markers)


def caused_by_comm_error(exc: BaseException) -> bool:
    """Whether a backend error is among the causes (``__cause__`` / ``__context__`` chain) of ``exc``."""
    seen = exc.__cause__ or exc.__context__
    while seen is not None:
        if is_comm_error(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(exc: BaseException) -> str:
    """The line of a backend error that says what happened: its last, C++ stack frames left out (torch appends
    them with ``TORCH_SHOW_CPP_STACKTRACES``)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    said = [ln for ln in lines if not ln.startswith(("frame #", "Exception raised from", "<omitting python frames>"))]
    return (said or lines)[-1] if lines else type(exc).__name__


def fingerprint_exchange(group=None) -> Callable[[str], list[str]]:
    """The ``exchange`` of a :class:`omnibal.data.sampler.BalancedBatchSampler`: this rank's schedule
    fingerprint in, every rank's of ``group`` out (in the group's rank order; ``None``: the default group),
    by one ``all_gather_object``. The data layer never looks up a process group: the trainer hands it this."""
    def exchange(fingerprint: str) -> list[str]:
        if not dist.is_initialized():
            return [fingerprint]
        out: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, fingerprint, group=group)
        return out

    return exchange


def free_port() -> int:
    """A TCP port free right now on localhost (rendezvous of local ranks; the one helper, tests use it too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankResult:
    """How one spawned rank ended."""

    rank: int
    exitcode: int | None
    """Process exit code (None: killed by spawn_local after its deadline)."""
    exception: BaseException | None = None
    """What the rank's function raised, as raised (an :class:`InputError` keeps its source, record and field;
    an exception that cannot be pickled arrives as a RuntimeError naming its type and message); None when it
    returned, or when the process ended without raising (see ``failure``). The rank printed the traceback of
    anything but an InputError on its own stderr."""
    value: Any = None
    """What the rank's function returned (must be picklable)."""
    failure: str | None = None
    """How the rank ended when it did not raise but did not return either: a non-zero exit, a signal, or
    killed after its deadline or its peer's failure."""

    @property
    def peer_failure(self) -> bool:
        """Whether the rank failed because another one did (a :class:`PeerFailure`): a consequence, not the
        cause, so reports name the others first."""
        return isinstance(self.exception, PeerFailure)

    @property
    def input_error(self) -> InputError | None:
        """The :class:`InputError` the rank raised (bad input, to report as one line), else None."""
        return self.exception if isinstance(self.exception, InputError) else None

    @property
    def path_error(self) -> OSError | None:
        """An ``OSError`` naming a path the rank could not read or write (a full disk, a vanished folder): one
        line that names the path, like an input error; else None."""
        return self.exception if is_path_error(self.exception) else None

    @property
    def error(self) -> str | None:
        """One line saying how the rank failed (the exception's type and message, or ``failure``); None when
        it succeeded."""
        return one_line(self.exception) if self.exception is not None else self.failure

    @property
    def message(self) -> str | None:
        """The same line as :attr:`error` (the name the CLI reads)."""
        return self.error


def root_causes_first(results: list[RankResult]) -> list[RankResult]:
    """The failed ranks, those whose failure is not a consequence of another's first (an exception of their
    own, a signal, a hang), then the ones that saw a peer fail; each group by rank."""
    failed = [r for r in results if r.error]
    return sorted(failed, key=lambda r: (r.peer_failure, r.rank))


def is_path_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an ``OSError`` that names its file: its one line says what failed where."""
    return isinstance(exc, OSError) and exc.filename is not None


def spawn_local(fn: Callable[..., Any], world_size: int, *, args: tuple = (), deadline_s: float = 600.0,
                master_port: int | None = None, env: dict[str, str] | None = None,
                start_method: str = "spawn", failure_grace_s: float = 60.0,
                print_tracebacks: bool = True) -> list[RankResult]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes with the env:// rendezvous variables set.

    Returns one RankResult per rank. Ranks still alive ``deadline_s`` after the start are killed (their
    exitcode is None), so a hang never outlives the deadline; once a rank has failed, the others get
    ``failure_grace_s`` to end (their collectives time out and name the peer), then the ones left -- e.g. a
    stopped (SIGSTOP) or hung rank -- are killed and named. A rank killed by a signal is reported with the
    signal's name (SIGKILL: most often the kernel's out-of-memory killer, which the cgroup's counters
    confirm when they can be read). ``start_method="fork"`` skips re-importing torch in every child (much
    faster on few cores); only use it from a parent that has not started a process group or torch worker
    threads.

    The ranks ignore SIGINT: a Ctrl-C reaches the whole process group, and it is the caller's to handle once
    (the parent stops the ranks and raises KeyboardInterrupt), not every rank's with a traceback of its own.
    ``print_tracebacks=False``: a rank that raised keeps its traceback in its exception's cause
    (:func:`remote_traceback`) instead of printing it, so the caller can say the cause first.
    """
    ctx = mp.get_context(start_method)
    port = master_port or free_port()
    results: Any = ctx.Queue()
    oom_before = _oom_kills()
    procs = []
    with _sigint_ignored_by_children():
        for rank in range(world_size):
            rank_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(world_size), **(env or {})}
            proc = ctx.Process(target=_rank_main, args=(fn, args, rank_env, results, print_tracebacks),
                               daemon=False)
            proc.start()
            procs.append(proc)
    reported: dict[int, tuple] = {}  # rank -> (exception, value)
    try:
        failed_at = _wait(procs, results, reported, time.monotonic() + deadline_s, failure_grace_s)
    except KeyboardInterrupt:
        _stop(procs)
        results.close()
        raise
    oom = _oom_kills() - oom_before if oom_before is not None else None
    out = []
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            state = _proc_state(proc.pid)
            proc.kill()
            proc.join(5)
            if failed_at is None:
                why = f"still running after {deadline_s:g} s"
            else:
                why = (f"{'stopped (SIGSTOP or a debugger)' if state in ('T', 't') else 'still running (hung?)'} "
                       f"{failed_at[1]:.0f} s after rank {failed_at[0]} failed")
            out.append(RankResult(rank, None, failure=f"rank {rank} {why}: killed"))
            continue
        exception, value = reported.get(rank, (None, None))
        failure = None
        if exception is None and proc.exitcode != 0:
            failure = f"rank {rank} {describe_exit(proc.exitcode, oom_kills=oom)}"
        out.append(RankResult(rank, proc.exitcode, exception, value, failure))
    results.close()
    return out


@contextlib.contextmanager
def _sigint_ignored_by_children():
    """SIGINT ignored while the ranks start: a child inherits the ignored disposition (across exec too, and
    Python then installs no KeyboardInterrupt handler), the parent gets its own handler back at once."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # signals are the main thread's: a caller elsewhere keeps the default
        return
    previous = signal_mod.signal(signal_mod.SIGINT, signal_mod.SIG_IGN)
    try:
        yield
    finally:
        signal_mod.signal(signal_mod.SIGINT, previous)


def _stop(procs, grace_s: float = 5.0) -> None:
    """End the ranks (SIGTERM, then SIGKILL for any still there after ``grace_s``) and reap them."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _wait(procs, results, reported: dict, deadline: float, grace_s: float) -> tuple[int, float] | None:
    """Drain the result queue (a rank blocks on exit until its result is read) until every rank has ended,
    the deadline passes, or ``grace_s`` after the first failure; returns (first failed rank, seconds waited
    since) when the grace ran out with ranks left."""
    first_failure: tuple[int, float] | None = None
    while time.monotonic() < deadline:
        try:
            rank, *item = results.get(timeout=0.1)
            reported[rank] = item
            continue
        except queue_mod.Empty:
            pass
        if all(not p.is_alive() for p in procs):
            break
        if first_failure is None:
            bad = [r for r, p in enumerate(procs) if reported.get(r, (None,))[0] is not None
                   or (not p.is_alive() and p.exitcode not in (0, None))]
            if bad:
                first_failure = (bad[0], time.monotonic())
        elif time.monotonic() - first_failure[1] > grace_s:
            break
    while True:
        try:
            rank, *item = results.get(timeout=0.2)
        except queue_mod.Empty:
            break
        reported[rank] = item
    if first_failure is None or all(not p.is_alive() for p in procs):
        return None
    return first_failure[0], time.monotonic() - first_failure[1]


def describe_exit(exitcode: int, *, oom_kills: int | None = None) -> str:
    """How a process ended, for a person: the signal's name, and for SIGKILL the out-of-memory killer."""
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        name = signal_mod.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    text = f"was killed by {name}"
    if -exitcode == getattr(signal_mod, "SIGKILL", 9):
        if oom_kills:
            text += (f": the kernel's out-of-memory killer ended {oom_kills} process(es) of this job's cgroup "
                     f"meanwhile (memory.events oom_kill); the rank ran out of memory")
        else:
            text += (" (exit code -9): most often the kernel's out-of-memory killer, when the machine or the "
                     "container ran out of memory (see `dmesg`), or someone ran kill -9")
    return text


def _oom_kills() -> int | None:
    """The cgroup's count of processes the out-of-memory killer ended (cgroup v2, else v1); None if unknown."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _proc_state(pid: int) -> str:
    """The process's state letter from /proc (``T``: stopped), or "" where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _rank_main(fn: Callable[..., Any], args: tuple, env: dict[str, str], results: Any,
               print_tracebacks: bool = True) -> None:
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        value = fn(*args)
    except BaseException as exc:  # report everything, including KeyboardInterrupt, then exit non-zero
        trace = None
        if not isinstance(exc, OmnibalError) and not is_path_error(exc):  # a bug or a crash: its traceback
            trace = "".join(traceback.format_exception(exc))
            if print_tracebacks:  # where Python would print it
                print(trace, end="", file=sys.stderr, flush=True)
        results.put((rank, sendable(exc, trace), None))
        results.close()
        results.join_thread()
        os._exit(1)  # no destroy_process_group: with a dead peer it may block; exiting frees the sockets
    results.put((rank, None, value))
    results.close()
    results.join_thread()
