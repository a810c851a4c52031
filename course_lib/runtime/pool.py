r"""Run a Python function on N real ranks: `run_on_ranks(fn, world_size=4)`.

Each rank is its own operating-system process with the default `torch.distributed`
process group initialised (gloo on CPU by default; NCCL on this machine's GPUs with
backend="nccl"), exactly as under `torchrun`.
The parent (your notebook) sends the function to every rank, the ranks run it, and
the return values come back as a list in rank order.

    parent (notebook kernel)
      |  cloudpickle(fn, args, kwargs)  ----->  rank 0   rank 1   rank 2   rank 3
      |                                          \________ process group ________/
      |  <---  (result, captured stdout/stderr) per rank
      v
    [result_0, result_1, result_2, result_3]

Why a persistent pool: starting a process and importing torch costs seconds, so the
ranks of one (world_size, backend) stay alive between calls and only the first call
pays for it. Why forkserver: the server imports torch once and every rank is a fork of
it, so starting 8 ranks on a 2-core laptop costs one torch import, not eight.

Failure handling (the kernel must never hang):
  * an exception on a rank     -> `RankError` naming the rank(s), with remote tracebacks;
  * a rank that never returns  -> `RankTimeout` after `timeout_s`, naming the stuck ranks;
  * a collective whose shapes/ops differ between ranks -> an error on the ranks
    (course_lib/observe/checks.py compares every collective's fingerprint), so a `RankError`
    rather than silently wrong numbers.
In every failure case the pool is killed, and the next call starts a fresh one. A port
taken by another program before rank 0 listens on it (EADDRINUSE) is not a failure: the
group starts again on another port.

(A little over 300 lines: the pool, its failure handling and run_on_ranks are read together.)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import time
import multiprocessing as mp
import pickle
from multiprocessing.connection import wait as wait_for_ready

import cloudpickle

from course_lib._validate import check_int
from course_lib.platform import LOOPBACK, start_method
from course_lib.runtime import worker as _worker
from course_lib.runtime.device import resolve_backend, threads_per_rank
from course_lib.runtime.modules import shared_modules

MAX_WORLD_SIZE = 64
# After the first rank fails, how long the others get to report before the pool is killed.
# Other ranks are usually stuck in a collective waiting for the failed one, so keep it short.
FAILURE_GRACE_S = 2.0
STARTUP_TIMEOUT_S = 180.0
# Imported once by the forkserver so every rank forks warm. A name that fails to import is
# skipped silently by multiprocessing (the warm start would be lost without a word), so the
# worker's name comes from the module itself and tests/test_runtime.py imports every entry.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "cloudpickle", _worker.__name__)


class RankError(RuntimeError):
    """One or more ranks raised an exception (or died). `.failures` maps rank -> traceback text."""

    def __init__(self, failures: dict[int, str], world_size: int):
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(r) for r in self.failures)
        parts = [f"{len(self.failures)} of {world_size} rank(s) failed: rank {ranks}"]
        for rank, tb in self.failures.items():
            parts.append(f"\n--- rank {rank} ---\n{tb.rstrip()}")
        super().__init__("\n".join(parts))


class RankTimeout(TimeoutError):
    """Some ranks did not finish within `timeout_s`. `.stuck_ranks` lists them."""

    def __init__(self, stuck_ranks: list[int], world_size: int, timeout_s: float):
        self.stuck_ranks = sorted(stuck_ranks)
        super().__init__(
            f"rank(s) {', '.join(map(str, self.stuck_ranks))} of {world_size} did not finish "
            f"within timeout_s={timeout_s:g} s (a rank stuck in a collective that another rank "
            f"never entered looks like this); the ranks were stopped and the next call starts fresh"
        )


PORT_ATTEMPTS = 3  # ports tried before a group that cannot listen is an error
ADDRESS_IN_USE = "address already in use"  # how torch's TCPStore reports EADDRINUSE (lowercased)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _validate(fn, world_size, timeout_s):
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    check_int("world_size", world_size, minimum=None)
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size={world_size} must be between 1 and {MAX_WORLD_SIZE} "
            f"(each emulated rank is a whole process)"
        )
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    if os.environ.get(_worker.INSIDE_RANK_ENV):
        raise RuntimeError("run_on_ranks was called from inside a rank; call it from the parent process")


def _mp_context():
    # The start method is the platform's choice (course_lib.platform.start_method: forkserver,
    # which forks every rank from a server that has already imported torch; spawn where the
    # platform has no forkserver).
    ctx = mp.get_context(start_method())
    if ctx.get_start_method() == "forkserver":
        # torch.optim pulls in torch._dynamo (hundreds of modules) on first optimizer use:
        # importing it once in the server saves every new rank that cost.
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


@contextlib.contextmanager
def _main_module_hidden():
    """Stop multiprocessing from re-running the caller's script in every rank.

    spawn/forkserver children normally re-import `__main__` so that functions defined
    there can be found by name. Our functions travel by cloudpickle instead, and re-running
    a script without an `if __name__ == "__main__"` guard would start ranks recursively.
    """
    main = sys.modules["__main__"]
    saved_file, saved_spec = getattr(main, "__file__", None), getattr(main, "__spec__", None)
    if saved_file is not None:
        del main.__file__
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


class RankPool:
    """`world_size` live worker processes sharing one process group."""

    def __init__(self, world_size: int, backend: str, check_collectives: bool):
        self.world_size, self.backend = world_size, backend
        # free_port() only finds a port that was free a moment ago: another program (a second
        # notebook, a test run) may take it before rank 0 listens on it. Then rank 0 fails with
        # EADDRINUSE and the group starts again on another port; any other error is raised.
        for attempt in range(PORT_ATTEMPTS):
            errors = self._start(free_port(), check_collectives)
            if not errors:
                return
            if attempt + 1 < PORT_ATTEMPTS and any(ADDRESS_IN_USE in m.lower() for m in errors.values()):
                continue
            raise RankError(errors, world_size)

    def _start(self, port: int, check_collectives: bool) -> dict[int, str]:
        """Start the ranks on `port` and wait until every one has joined the process group:
        {} then, else {rank: error} (the ranks killed). A rank that neither joins nor fails in
        STARTUP_TIMEOUT_S raises RankTimeout."""
        world_size, backend = self.world_size, self.backend
        ctx = _mp_context()
        n_threads = threads_per_rank(world_size)
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_worker.worker_main,
                args=(rank, world_size, backend, port, child_end, n_threads, check_collectives),
                daemon=True,
                name=f"course-rank-{rank}",
            )
            with _main_module_hidden():
                p.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(p)
        replies = self._collect(STARTUP_TIMEOUT_S)
        errors = {r: msg[1] for r, msg in replies.items() if msg[0] != "ready"}
        if errors or len(replies) < world_size:
            self.kill()
            if not errors:
                raise RankTimeout([r for r in range(world_size) if r not in replies], world_size, STARTUP_TIMEOUT_S)
        return errors

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, payload: bytes, timeout_s: float) -> dict[int, tuple]:
        for conn in self.conns:
            conn.send_bytes(payload)
        return self._collect(timeout_s)

    def _collect(self, timeout_s: float) -> dict[int, tuple]:
        """Wait for one message per rank. Stops early (after a short grace) once a rank fails."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        waiting = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = wait_for_ready(list(waiting) + [s for s, r in sentinels.items() if r not in replies],
                                   timeout=min(remaining, 0.5))
            for obj in ready:
                if obj in waiting:
                    rank = waiting.pop(obj)
                    try:
                        replies[rank] = obj.recv()
                    except (EOFError, OSError):
                        replies[rank] = ("error", "the rank's process exited unexpectedly", "", "")
                elif obj in sentinels and sentinels[obj] not in replies:
                    rank = sentinels[obj]
                    if self.conns[rank].poll():  # the result raced the exit; read it
                        continue
                    code = self.procs[rank].exitcode
                    replies[rank] = ("error", f"the rank's process died (exit code {code})", "", "")
                    waiting.pop(self.conns[rank], None)
            if any(m[0] == "error" for m in replies.values()):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return replies

    def shutdown(self):
        for conn in self.conns:
            try:
                conn.send_bytes(b"")  # empty message = exit
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=3)
        self.kill()

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for conn in self.conns:
            conn.close()


_POOLS: dict[tuple, RankPool] = {}
# Pools kept alive at once (2, 4 and 8 ranks in one notebook); older ones are shut down.
MAX_LIVE_POOLS = 3


def _get_pool(world_size: int, backend: str, check_collectives: bool) -> RankPool:
    key = (world_size, backend, check_collectives)
    pool = _POOLS.get(key)
    if pool is not None and not pool.alive():
        _POOLS.pop(key).kill()
        pool = None
    if pool is None:
        while len(_POOLS) >= MAX_LIVE_POOLS:
            _POOLS.pop(next(iter(_POOLS))).shutdown()
        pool = RankPool(world_size, backend, check_collectives)
    else:
        _POOLS.pop(key)
    _POOLS[key] = pool  # most recently used last
    return pool


def live_pools() -> list[tuple]:
    """The (world_size, backend, check_collectives) keys of the pools alive now, oldest first."""
    return list(_POOLS)


def shutdown_pools():
    """Stop every live rank pool (called automatically at interpreter exit)."""
    while _POOLS:
        _POOLS.popitem()[1].shutdown()


atexit.register(shutdown_pools)


def _print_rank_output(replies: dict[int, tuple]):
    """Print each rank's captured output, grouped by rank, in rank order (deterministic)."""
    for stream_index, stream in ((2, sys.stdout), (3, sys.stderr)):
        for rank in sorted(replies):
            text = replies[rank][stream_index] if len(replies[rank]) > stream_index else ""
            for line in text.splitlines():
                print(f"[rank {rank}] {line}", file=stream)
    sys.stdout.flush()


def run_on_ranks(fn, *args, world_size: int = 4, backend: str = "gloo", timeout_s: float = 60,
                 check_collectives: bool = True, on_timeout=None, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` ranks and return the results in rank order.

    Inside `fn` the default process group is initialised: `dist.get_rank()`,
    `dist.get_world_size()` and every collective work. Each call starts every rank from
    the same RNG state (`torch.manual_seed(rank)`), so results do not depend on what ran
    before in the pool. What the ranks print is captured and printed here, prefixed
    `[rank r]`, grouped in rank order.

    fn may be a lambda or a closure defined in a notebook (it travels by cloudpickle).
    backend="gloo" (the default) runs emulated CPU ranks even on a GPU machine: the notebooks'
    stored outputs come from them. backend="nccl" puts rank r on GPU r of this machine (one GPU
    per rank, else ValueError); "auto" is NCCL when there are enough GPUs, else gloo
    (course_lib.runtime.device.resolve_backend).
    check_collectives=True verifies before each collective that all ranks of its group call
    the same op with the same dtype and shape (course_lib/observe/checks.py; one extra tiny
    all-gather per collective, so benchmarks turn it off).

    on_timeout(stuck_ranks), if given, is called when timeout_s has passed, while the stuck
    ranks still run, before they are stopped (run_recorded asks their flight recorders for a
    dump there).

    Raises RankError (a rank raised or died), RankTimeout (ranks still running after
    timeout_s), ValueError (bad arguments, before any process starts).
    """
    _validate(fn, world_size, timeout_s)
    if on_timeout is not None and not callable(on_timeout):
        raise TypeError(f"on_timeout={on_timeout!r} must be callable (it is called with the stuck ranks)")
    backend = resolve_backend(backend, world_size)
    try:
        # Shared modules go first: a rank installs them before unpickling fn (course_lib.runtime.modules).
        payload = pickle.dumps((shared_modules(), cloudpickle.dumps((fn, args, kwargs))))
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise TypeError(f"could not send fn and its arguments to the ranks (cloudpickle failed: {e})") from e
    pool = _get_pool(world_size, backend, check_collectives)
    key = (world_size, backend, check_collectives)
    try:
        replies = pool.run(payload, timeout_s)
    except BaseException:  # KeyboardInterrupt in the kernel: never leave ranks mid-call
        _POOLS.pop(key, None)
        pool.kill()
        raise
    _print_rank_output(replies)
    failures = {r: m[1] for r, m in replies.items() if m[0] == "error"}
    if failures or len(replies) < world_size:
        _POOLS.pop(key, None)
        stuck = [r for r in range(world_size) if r not in replies]
        try:
            if not failures and on_timeout is not None:
                on_timeout(stuck)
        finally:
            pool.kill()
        if failures:
            raise RankError(failures, world_size)
        raise RankTimeout(stuck, world_size, timeout_s)
    return [cloudpickle.loads(replies[r][1]) for r in range(world_size)]
