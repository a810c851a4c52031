"""NCCL's point-to-point rules, enforced on gloo CPU ranks (COURSE_NCCL_RULES=1).
(A few lines over 300: matching, rendezvous and the deadlock's explanation read the same
published calls, and belong together.)

gloo is forgiving where NCCL is not, so code that passes on CPU ranks can hang or receive the
wrong buffer on GPUs. NCCL's User Guide ("Point-to-point communication" and the ncclSend/ncclRecv
API pages, docs.nvidia.com/deeplearning/nccl): a send needs a matching receive on the peer with
the same count and data type; each call is blocking for the GPU, so calls that must progress at
the same time have to be fused in one group (ncclGroupStart/End, which batch_isend_irecv issues),
within which they progress independently. PyTorch's ProcessGroupNCCL ignores `tag` and runs a
pair's calls on one stream, in issue order. With this layer on, every rank obeys:

1. Matching in issue order, tags ignored: the k-th send from a to b goes into b's k-th receive
   from a (per process group). A different dtype or shape, or different tags (the code relied
   on them), raises NcclRuleError on both ranks naming both calls. The real gloo call is
   re-tagged with k, so gloo delivers exactly what NCCL would.
2. Rendezvous: a rank's calls with one peer run one after the other (a batch is one step, its
   calls concurrent); a send completes once its receive runs, a receive once its send runs;
   wait() and the blocking send/recv return only then. Waiting ranks publish what they wait on,
   and a cycle of waits that cannot finish raises NcclRuleError naming each rank and call
   (never a hang); a wait longer than COURSE_NCCL_RULES_WAIT_S (30 s) raises too.
3. gloo-only calls refused: monitored_barrier, a receive from any source, bitwise reductions.

Each rank writes its calls into the group's TCPStore (key ncclr/<epoch>/<group>/<me>-<peer>/i
and a counter); matching reads the peer's list. Stricter than NCCL in one way: no eager sends
(a message below NCCL's buffer size may complete before its receive is posted on a GPU); a
batch's calls to different peers are modelled per peer. On for one rank call with
`under_rules(fn)` (a pool keeps the environment its forkserver started with), for every call with
COURSE_NCCL_RULES=1 set before the first pool starts (runtime/worker.py), for torchrun demos in
runtime/launch.py. The same variable turns on NCCL's device rule (observe/device_rule.py: every
communicated tensor on the rank's device); `under_rules` alone does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course_lib.observe import patching

RULES_ENV = "COURSE_NCCL_RULES"
WAIT_ENV = "COURSE_NCCL_RULES_WAIT_S"
_P2P = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv"}
_BITWISE = {"BAND", "BOR", "BXOR"}
_REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single"}


class NcclRuleError(RuntimeError):
    """A call that NCCL would refuse, mismatch, or deadlock on."""


def enabled_in_env() -> bool:
    return os.environ.get(RULES_ENV, "") == "1"


class _Rules:
    """The patching layer; its state lives for one `enforced` block (one epoch)."""

    ops = frozenset(_P2P) | {"batch_isend_irecv", "monitored_barrier"} | _REDUCING

    epoch = 0

    # --- the store: one list of calls per (group, rank, peer) --------------------------------
    def reset(self):  # lists: (group, a, b) -> a's calls with b; counts: (group, a, b, kind) -> n
        self.epoch, self.blocked, self.lists, self.counts = self.epoch + 1, 0, {}, {}
        self.store, self.me = c10d._get_default_store(), dist.get_rank()

    def _key(self, g, a, b):
        return f"ncclr/{self.epoch}/{g}/{a}-{b}"

    def read(self, g, a, b) -> list:
        """a's calls with b on group g so far (each list is append-only: cached)."""
        got = self.lists.setdefault((g, a, b), [])
        n = self.store.add(self._key(g, a, b) + "/n", 0)
        for i in range(len(got), n):
            got.append(json.loads(self.store.get(f"{self._key(g, a, b)}/{i}")))
        return got

    def post(self, g, peer, calls: list[dict]) -> list[int]:
        """Append this rank's calls with `peer` (one unit: a batch or a single call); their indices."""
        mine = self.read(g, self.me, peer)
        unit, first = len(mine), len(mine)
        for c in calls:
            kind = (g, self.me, peer, c["kind"])
            c.update(unit=unit, n=self.counts.get(kind, 0), rank=self.me, peer=peer)
            self.counts[kind] = c["n"] + 1
            self.store.set(f"{self._key(g, self.me, peer)}/{len(mine)}", json.dumps(c))
            mine.append(c)
        self.store.add(self._key(g, self.me, peer) + "/n", len(calls))
        return list(range(first, len(mine)))

    # --- the model: which calls of a pair have completed -------------------------------------
    @staticmethod
    def progress(a: list, b: list) -> tuple[int, int]:
        """How many leading calls of a and of b complete: each side runs its units in order; a
        call completes when its partner (the other side's call of the other kind, same n) runs."""
        index = [{(c["kind"], c["n"]): i for i, c in enumerate(side)} for side in (a, b)]
        done, sides = [0, 0], (a, b)

        def end(s):  # one past the unit now running on side s
            i = done[s]
            while i < len(sides[s]) and sides[s][i]["unit"] == sides[s][done[s]]["unit"]:
                i += 1
            return i

        moved = True
        while moved:
            moved = False
            for s in (0, 1):
                if done[s] == len(sides[s]):
                    continue
                e, other = end(s), 1 - s
                partners = [index[other].get(("recv" if c["kind"] == "send" else "send", c["n"]))
                            for c in sides[s][done[s]:e]]
                if all(p is not None and p < end(other) for p in partners):
                    done[s], moved = e, True
        return done[0], done[1]

    def check_match(self, c, theirs: list):
        want = ("recv" if c["kind"] == "send" else "send", c["n"])
        other = next((o for o in theirs if (o["kind"], o["n"]) == want), None)
        if other is None:
            return
        send, recv = (c, other) if c["kind"] == "send" else (other, c)
        if (send["shape"], send["dtype"], send["tag"]) != (recv["shape"], recv["dtype"], recv["tag"]):
            why = "tags differ: NCCL ignores tags" if send["tag"] != recv["tag"] else "NCCL needs the same dtype and count"
            raise NcclRuleError(
                f"NCCL rules: point-to-point calls are matched in issue order between a pair ({why}): "
                f"{_describe(send)} is the message NCCL delivers into {_describe(recv)}")

    # --- waiting: the rendezvous, deadlock detection -----------------------------------------
    def wait(self, g, peer, idx: list[int]):
        limit = float(os.environ.get(WAIT_ENV, "30"))
        start, pause, mark = time.monotonic(), 0.0005, f"ncclr/{self.epoch}/blocked/{self.me}"
        while True:
            mine, theirs = self.read(g, self.me, peer), self.read(g, peer, self.me)
            for i in idx:
                self.check_match(mine[i], theirs)
            if self.progress(mine, theirs)[0] > max(idx):
                if self.blocked:  # kept on an error: the peers of a deadlock find the cycle too
                    self.store.set(mark, "[]")
                    self.blocked = 0
                return
            waited = time.monotonic() - start
            if waited > 0.05 and not self.blocked:
                self.blocked = 1
                self.store.set(mark, json.dumps([g, peer, max(idx)]))
            if self.blocked:
                self.find_cycle(g, peer, max(idx))
            if waited > limit:
                raise NcclRuleError(f"NCCL rules: {_describe(mine[max(idx)])} waited {limit:g} s ({WAIT_ENV}) for "
                                    f"its partner: {self.explain(g, self.me, peer, max(idx))}")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def marks(self) -> dict:  # rank -> [group, peer, call] it waits on ([] or absent: none)
        keys = [f"ncclr/{self.epoch}/blocked/{r}" for r in range(dist.get_world_size())]
        return {r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if self.store.check([k])}

    def find_cycle(self, g, peer, i):
        """Follow 'rank x waits on its call i with y' marks from this rank; a cycle of calls that
        cannot complete with what both sides have posted is a deadlock (both CPUs wait)."""
        before = self.marks()
        chain, x, link = [], self.me, [g, peer, i]
        while link and x not in [c[0] for c in chain]:
            lg, y, li = link[:3]
            a, b = self.read(lg, x, y), self.read(lg, y, x)
            if self.progress(a, b)[0] > li:
                return  # that rank's call can complete: not stuck
            chain.append((x, lg, y, li))
            x, link = y, before.get(y) or None
        if not link or x != self.me or self.marks() != before:
            return  # the chain ends at a rank that is not waiting, or a mark moved meanwhile
        lines = [f"  rank {x}: {self.explain(lg, x, y, li)}" for x, lg, y, li in chain]
        hint = ""
        if len(chain) == 2 and all(self.read(lg, x, y)[li]["kind"] == "send" for x, lg, y, li in chain):
            hint = ("\nboth ranks send first: NCCL hangs on this above its eager size; order the two "
                    "calls by rank parity or issue them as one batch_isend_irecv")
        raise NcclRuleError("NCCL rules: deadlock, each rank waits on a point-to-point call whose "
                            "partner cannot run yet (NCCL runs a pair's calls in issue order):\n"
                            + "\n".join(lines) + hint)

    def explain(self, g, x, y, i) -> str:
        a, b = self.read(g, x, y), self.read(g, y, x)
        (fa, fb), c = self.progress(a, b), a[i]
        behind = f", queued behind {_describe(a[fa])}," if a[fa]["unit"] != c["unit"] else ""
        return (f"{_describe(c)}{behind} waits for rank {y}'s matching {'receive' if c['kind'] == 'send' else 'send'}; "
                f"rank {y}'s next call with rank {x} is " + (_describe(b[fb]) if fb < len(b) else "not issued yet"))

    # --- the layer ---------------------------------------------------------------------------
    def around(self, op, a, call):
        if op == "monitored_barrier":
            raise NcclRuleError("NCCL rules: monitored_barrier is gloo-only; NCCL has no such call "
                                "(use barrier, or a flight recorder to find a stuck rank)")
        if op in _REDUCING:
            name = getattr(a.get("op"), "name", str(a.get("op")))
            if any(b in name for b in _BITWISE):
                raise NcclRuleError(f"NCCL rules: {op} with {name}: NCCL has no bitwise reductions")
            return call()
        if op == "batch_isend_irecv":
            return self.batch(a["p2p_op_list"], call)
        kind, group = _P2P[op], a["group"]
        peer_arg, group_arg = ("dst", "group_dst") if kind == "send" else ("src", "group_src")
        peer = a[peer_arg] if a[peer_arg] is not None else (
            None if a[group_arg] is None else dist.get_global_rank(group, a[group_arg]))
        if peer is None:
            raise NcclRuleError(f"NCCL rules: {op} from any source (src=None) is gloo-only; NCCL needs the peer")
        g = _group_name(group)
        (i,) = self.post(g, peer, [_call(op, kind, a["tensor"], a["tag"])])
        self.check_match(self.lists[(g, self.me, peer)][i], self.read(g, peer, self.me))
        n = self.lists[(g, self.me, peer)][i]["n"]
        if op in ("send", "recv"):  # blocking: the rendezvous first, then gloo's own call
            self.wait(g, peer, [i])
            return call(tag=n)
        return _RuledWork(call(tag=n), self, [(g, peer, [i])])

    def batch(self, ops, call):
        by_peer, retagged = {}, []
        for p in ops:
            kind = "send" if p.op.__name__ == "isend" else "recv"
            g = _group_name(p.group)
            by_peer.setdefault((g, p.peer), []).append((p, _call("batch_isend_irecv", kind, p.tensor, p.tag)))
        waits, numbered = [], {}
        for (g, peer), pairs in by_peer.items():
            idx = self.post(g, peer, [c for _, c in pairs])
            waits.append((g, peer, idx))
            for (p, c), i in zip(pairs, idx):
                self.check_match(c, self.read(g, peer, self.me))
                numbered[id(p)] = c["n"]
        for p in ops:  # the functions installed now (P2POp checks `op` against them)
            fn = c10d.isend if p.op.__name__ == "isend" else c10d.irecv
            retagged.append(dist.P2POp(fn, p.tensor, p.peer, p.group, tag=numbered[id(p)]))
        return [_RuledWork(w, self, waits) for w in call(p2p_op_list=retagged)]


class _RuledWork:
    """A point-to-point Work whose wait() first waits for NCCL's rendezvous."""

    def __init__(self, work, rules, waits):
        self._work, self._rules, self._waits, self._done = work, rules, waits, False

    def wait(self, *args, **kwargs):
        if not self._done:
            for g, peer, idx in self._waits:
                self._rules.wait(g, peer, idx)
            self._done = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _group_name(group) -> str:
    return (group if group is not None else c10d._get_default_group()).group_name


def _call(op, kind, tensor, tag) -> dict:
    return {"op": op, "kind": kind, "shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""),
            "tag": tag}


def _describe(c) -> str:
    """'rank 0 isend #2 to rank 1 (shape [4], float32, tag 0)': #k counts the pair's messages one way."""
    call = f"batched {c['kind']}" if c["op"] == "batch_isend_irecv" else c["op"]
    direction = "to" if c["kind"] == "send" else "from"
    return (f"rank {c['rank']} {call} #{c['n'] + 1} {direction} rank {c['peer']} "
            f"(shape {c['shape']}, {c['dtype']}, tag {c['tag']})")


RULES = _Rules()


@contextlib.contextmanager
def enforced(on: bool = True):
    """NCCL's rules on (or off) for this rank while the block runs; every rank of the group
    must enter it together (a new epoch of store keys)."""
    was = RULES in patching.active_layers()
    if on:
        RULES.reset()
    (patching.add_layer if on else patching.remove_layer)(RULES)
    try:
        yield
    finally:
        (patching.add_layer if was else patching.remove_layer)(RULES)


def install_from_env() -> bool:
    """For torchrun processes: the rules on for the rest of the process if COURSE_NCCL_RULES=1."""
    if enabled_in_env() and RULES not in patching.active_layers():
        RULES.reset()
        patching.add_layer(RULES)
    return enabled_in_env()


class under_rules:  # noqa: N801 - used like a function: run_on_ranks(under_rules(fn), ...)
    """fn with NCCL's rules on (on=False: off) on every rank, whatever the environment."""

    def __init__(self, fn, on: bool = True):
        self.fn, self.on = fn, on

    def __call__(self, *args, **kwargs):
        with enforced(self.on):
            return self.fn(*args, **kwargs)
