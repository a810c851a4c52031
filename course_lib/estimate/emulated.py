"""The alpha-beta-gamma cost model of collectives on emulated ranks (processes sharing a CPU).

Formulas only: the constants come from micro-benchmarks (course_lib.measure.emulated_fit) and
the result is seconds. A collective of S bytes per rank on N ranks running on C cores takes

    T = s t0  +  sum over the busiest rank's messages m of x(m) or x+(m)  +  r S gamma sigma  +  k

    t0      a start: one step of a 4-byte ring timed as a collective is (from a barrier to the
            slowest rank's end), what a rank pays when its partner reaches a step on its own
            time, not in step with it. 0 in costmodel.
    s       starts(): how many such waits the busiest rank meets one after another. It depends on
            whether the ranks share cores:
            * more ranks than cores (the wait after an add is in x+(m)): the partners met one
              after another, each reaching its step on its own time, from wherever its previous
              step left it, and descheduled meanwhile: 1 for the ring,
              whose two neighbours stay the same all through; N-1 for the all-to-all, a new
              partner each step; log2 p for recursive doubling and 2 log2 p - 1 for Rabenseifner
              (its gather meets the scatter's last partner again first), +2 when N != p (the
              folded-in rank, before and after); the parameter server's N-1 workers one by one,
              then its sends at once: N; the sharded server 2(N-1) rounds, each with a new
              partner. Measured here (benchmarks/bench_collectives.py, 4 ranks on 2 cores): the
              1 MiB all-to-all took 3.4-5.2 ms in five runs where one start and its three
              exchanges came to 2.8-3.6 ms (8-46% low); with a start per partner it was within
              -23% to +7% in the next three.
            * a core per rank (x(m) measured back to back): the exchanges that follow an add of
              the rank's own (adds_before_exchanges()): the partner adds too and arrives when
              its add is done. A first exchange from a barrier costs what one in a row does
              (both ranks are running), and a new partner is running too. Measured here on 2
              ranks with a core each: a start per partner priced the 1 MiB all-to-all (one
              exchange, no add) 21-52% high in six runs, and the 16 MiB tree (8 pieces, 7 of
              them after an add) 0-28% low; with a start per exchange after an add, every
              2-rank case of those six runs was within -31% to +12%, and of the next five
              within -28% to +16%.

    x(m)    seconds of one exchange of m bytes (a rank sends m and receives m at once, as every
            step of the course's collectives does), measured with every pair of ranks exchanging
            at the same time, as in a collective, back to back: between two measured sizes it is
            the alpha-beta line through them, x(m) = alpha_i + m / beta_i, beyond either end the
            end line. On a network one line would do (Hockney 1994); between processes a message
            is memory copies through the kernel's socket buffers, a message far larger than
            those buffers crosses in many refills, each waiting for a process to be scheduled,
            and with more ranks than cores the copies of all ranks take turns on the same cores:
            beta changes with m and with N. Hence a measured table of lines, not one line.
    x+(m)   when ranks outnumber cores, an exchange that follows an add (adds_before_exchanges()
            of them on the busiest rank) is priced by its own table, measured with each exchange
            after the add of what the one before brought (course_lib.measure.emulated_fit): a
            rank that computed gives up its core and must be scheduled again before its next
            message moves, and its partners wait for that. The other exchanges (the
            all-gather's, the all-to-all's, the first) run back to back: x(m). The after-add
            exchanges are spread over the busiest rank's messages in proportion to their counts
            (exact where its messages are of one size: the ring, recursive doubling on a power
            of two). Measured here (benchmarks/bench_collectives.py, 4 ranks on 2 cores, six
            runs): at 256 KiB x+ was 0.67-0.89 ms against x 0.52-0.64 ms; pricing every exchange
            by x+ put the 4-rank all-to-all 8-39% high (largest errors 20-39%), the split above
            within -23% to +24% (largest errors 19-24%; 25-26% in the next three runs, the 1 MiB
            trees 16-26% low). With a core per rank nobody is descheduled: the exchanges after
            an add pay a start t0 instead (s above).
    messages  the busiest rank's sequential messages (messages()): the ring 2(N-1) steps of one
            chunk S/N, cut into pieces of at most piece_bytes (the course's ring sends 2 MiB
            pieces); recursive doubling log2 p messages of S (in pieces too: p2p.PIECE_BYTES);
            Rabenseifner S/2, S/4, ... S/p and back; an all-to-all N-1 messages of S/N; N != p
            adds the fold-in's 2 messages of S (the first in pieces).
            With one alpha-beta line and whole chunks the sum is costmodel's a alpha + b S / beta.
            Where beta falls with m, one more piece can make a larger tensor faster: why the
            ring cuts its chunks.
    r       bytes ADDED by the busiest rank per byte of S (reduction_terms): the ring (N-1)/N,
            recursive doubling log2 p, Rabenseifner (p-1)/p, the parameter server N-1, an
            all-to-all 0. gamma: seconds per byte added, by one rank with a core to itself (the
            gamma per reduced byte of Thakur, Rabenseifner & Gropp 2005 and Chan et al. 2007). On a
            GPU the add hides under the transfer and the cluster model leaves it out; on a CPU
            the cores that copy the bytes also add them, one after the other.
    k       the all-to-all's local copy: a rank's own part S/N goes from its input to its output
            by a memory copy, not a message: 2 S/N bytes read and written at one rank's copy
            rate while every rank copies (copy_all), as all ranks copy their parts at once. The
            ring and the tree work in place: 0.
    sigma   the cores' shared memory bandwidth (sharing()): 1 when N <= C; else copy_cores /
            copy_all, one rank's copy rate when C ranks copy at once over its rate when all N do:
            with more ranks than cores the adds of all ranks take turns on the same cores and
            memory channels (the exchanges' turns are in x(m) already, measured all at once).

On a real network x(m) is one line with the link's alpha and beta, gamma is the accelerator's
(small beside the transfer, and overlapped with it), k is a device copy at hundreds of GB/s and
sigma is 1: every rank has its own device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib._validate import check_int


@dataclass(frozen=True)
class EmulatedConstants:
    """sizes/seconds: measured exchanges back to back (bytes ascending, seconds per exchange);
    after_add: seconds per exchange after an add at the same sizes, x+(m) (empty: not measured,
    as where ranks have a core each; the model then reads `seconds`); gamma: seconds per byte
    added; cores: the cores the ranks share; copy_cores / copy_all: one rank's copy bytes/s with
    `cores` ranks copying at once / with every rank copying at once; start: t0."""

    sizes: tuple
    seconds: tuple
    gamma: float
    cores: int
    copy_cores: float = 1.0
    copy_all: float = 1.0
    start: float = 0.0
    after_add: tuple = ()

    def __post_init__(self):
        if len(self.sizes) < 2 or len(self.sizes) != len(self.seconds) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"need >= 2 distinct ascending sizes, one time each; got sizes={self.sizes}, "
                             f"seconds={self.seconds}")
        if (any(t <= 0 for t in self.seconds) or self.gamma < 0 or self.start < 0 or self.copy_cores <= 0
                or self.copy_all <= 0):
            raise ValueError(f"need seconds, copy rates > 0 and gamma, start >= 0, got {self}")
        if self.after_add and (len(self.after_add) != len(self.sizes) or any(t <= 0 for t in self.after_add)):
            raise ValueError(f"after_add needs one time > 0 per size ({len(self.sizes)}) or none; got {self.after_add}")
        check_int("cores", self.cores)


def exchange_time(m: float, c: EmulatedConstants, after_add: bool = False) -> float:
    """x(m), or x+(m) with after_add where it was measured: seconds of one exchange of m bytes
    (the alpha-beta line through the two measured sizes around m; beyond either end, the end
    line). 0 for an empty message."""
    if m <= 0:
        return 0.0
    s, t = c.sizes, (c.after_add if after_add and c.after_add else c.seconds)
    i = 0
    while i < len(s) - 2 and m > s[i + 1]:
        i += 1
    slope = (t[i + 1] - t[i]) / (s[i + 1] - s[i])  # 1 / beta_i
    return max(t[i] + (m - s[i]) * slope, 0.0)


def _pieces(nbytes: float, world_size: int, piece_bytes: float | None) -> tuple[int, int]:
    """(pieces of a chunk S/N, pieces of the whole S): how the course cuts messages larger than
    piece_bytes (1 each when not cut)."""
    if not piece_bytes:
        return 1, 1
    return max(1, math.ceil(nbytes / world_size / piece_bytes)), max(1, math.ceil(nbytes / piece_bytes))


def messages(algorithm: str, nbytes: float, world_size: int, piece_bytes: float | None = None) -> list:
    """[(count, bytes)]: the busiest rank's sequential messages (see the module docstring)."""
    n, s = check_int("world_size", world_size), float(nbytes)
    if n == 1:
        return []
    p = 1 << (n.bit_length() - 1)
    chunk = s / n
    pieces, whole = _pieces(s, n, piece_bytes)
    fold = []
    if n != p:  # the folded-in tensor (in pieces, when cut) and the answer sent back (whole)
        fold = [(2, s)] if whole == 1 else [(whole, s / whole), (1, s)]
    table = {
        "ring": [(2 * (n - 1) * pieces, chunk / pieces)],
        "reduce_scatter": [((n - 1) * pieces, chunk / pieces)],
        "all_gather": [((n - 1) * pieces, chunk / pieces)],
        "all_to_all": [(n - 1, chunk)],
        "tree": [(int(math.log2(p)) * whole, s / whole)] + fold,
        "rabenseifner": [(2, s / 2**k) for k in range(1, int(math.log2(p)) + 1)] + fold,
        "ps": [(2 * (n - 1), s)],
        "sharded_ps": [(2 * (n - 1), chunk)],
    }
    if algorithm not in table:
        raise ValueError(f"algorithm={algorithm!r} is unknown: use one of {', '.join(table)}")
    return table[algorithm]


def starts(algorithm: str, world_size: int, nbytes: float = 0.0, piece_bytes: float | None = None,
           cores: int | None = None) -> int:
    """s: the waits for a partner that reaches its step on its own time (see the module
    docstring). cores None or fewer than world_size (ranks share cores): the partners the busiest
    rank meets one after another. Else (a core per rank): adds_before_exchanges()."""
    n = check_int("world_size", world_size)
    if n == 1:
        return 0
    if cores is not None and n <= check_int("cores", cores):
        return adds_before_exchanges(algorithm, nbytes, n, piece_bytes)
    p = 1 << (n.bit_length() - 1)
    rounds, fold = int(math.log2(p)), 2 if n != p else 0
    table = {"ring": 1, "reduce_scatter": 1, "all_gather": 1, "all_to_all": n - 1, "tree": rounds + fold,
             "rabenseifner": 2 * rounds - 1 + fold, "ps": n, "sharded_ps": 2 * (n - 1)}
    if algorithm not in table:
        raise ValueError(f"algorithm={algorithm!r} is unknown: use one of {', '.join(table)}")
    return table[algorithm]


def adds_before_exchanges(algorithm: str, nbytes: float, world_size: int, piece_bytes: float | None = None) -> int:
    """The busiest rank's adds that an exchange follows (the course's collectives, cut into pieces
    as messages() cuts them): the ring adds each of its (N-1) reduce-scatter pieces, and every one
    is followed by the next step's exchange (the last by the all-gather's first); a
    reduce-scatter alone ends on its last add. Recursive doubling adds every piece of log2 p
    rounds and ends on an add, unless a folded-in rank waits for the answer (+1) whose tensor it
    added first (+ its pieces). Rabenseifner: log2 p halving adds, the last followed by the
    gather, + the fold-in's pieces. The parameter server adds N-1 tensors, each followed by a
    receive or its sends; the sharded server adds once, before the pull. All-gather and
    all-to-all add nothing."""
    n = check_int("world_size", world_size)
    if n == 1:
        return 0
    p = 1 << (n.bit_length() - 1)
    rounds = int(math.log2(p))
    pieces, whole = _pieces(float(nbytes), n, piece_bytes)
    fold = whole if n != p else 0  # the folded-in tensor's pieces, each added, then an exchange
    table = {"ring": (n - 1) * pieces, "reduce_scatter": (n - 1) * pieces - 1, "all_gather": 0, "all_to_all": 0,
             "tree": rounds * whole + fold - (1 if n == p else 0), "rabenseifner": rounds + fold,
             "ps": n - 1, "sharded_ps": 1}
    if algorithm not in table:
        raise ValueError(f"algorithm={algorithm!r} is unknown: use one of {', '.join(table)}")
    return table[algorithm]


def reduction_terms(algorithm: str, world_size: int) -> float:
    """r: bytes the busiest rank adds per byte of S (see the module docstring)."""
    n = check_int("world_size", world_size)
    if n == 1:
        return 0.0
    p = 1 << (n.bit_length() - 1)
    fold = 1.0 if n != p else 0.0  # a rank < N - p adds its folded-in partner's whole tensor first
    terms = {"ring": (n - 1) / n, "reduce_scatter": (n - 1) / n, "sharded_ps": (n - 1) / n, "ps": float(n - 1),
             "tree": math.log2(p) + fold, "rabenseifner": (p - 1) / p + fold, "all_gather": 0.0, "all_to_all": 0.0}
    if algorithm not in terms:
        raise ValueError(f"algorithm={algorithm!r} is unknown: use one of {', '.join(terms)}")
    return terms[algorithm]


def sharing(world_size: int, c: EmulatedConstants) -> float:
    """sigma: 1 when ranks <= cores, else how much slower one rank copies when all copy at once
    than when `cores` ranks do (at least 1)."""
    if world_size <= c.cores:
        return 1.0
    return max(1.0, c.copy_cores / c.copy_all)


def terms(algorithm: str, nbytes: float, world_size: int, c: EmulatedConstants,
          piece_bytes: float | None = None) -> dict:
    """The model's parts in seconds: {"start": s t0, "messages": sum of x(m) and x+(m), "gamma":
    r S gamma, "sharing": what sigma adds to the adds, "copy": k}; predict() is their sum."""
    sequence = messages(algorithm, nbytes, world_size, piece_bytes)
    after = 0.0  # the share of the messages that follow an add, priced by x+ where ranks share cores
    if sequence and world_size > c.cores and c.after_add:
        follows = adds_before_exchanges(algorithm, nbytes, world_size, piece_bytes)
        after = min(1.0, follows / sum(k for k, _ in sequence))
    sent = sum(k * ((1 - after) * exchange_time(m, c) + after * exchange_time(m, c, after_add=True))
               for k, m in sequence)
    added = reduction_terms(algorithm, world_size) * nbytes * c.gamma
    own = nbytes / world_size if algorithm == "all_to_all" and world_size > 1 else 0.0
    return {"start": starts(algorithm, world_size, nbytes, piece_bytes, c.cores) * c.start, "messages": sent, "gamma": added,
            "sharing": added * (sharing(world_size, c) - 1.0), "copy": 2 * own / c.copy_all}


def predict(algorithm: str, nbytes: float, world_size: int, c: EmulatedConstants,
            piece_bytes: float | None = None) -> float:
    """Seconds for one `algorithm` collective of `nbytes` per rank on `world_size` emulated ranks."""
    return sum(terms(algorithm, nbytes, world_size, c, piece_bytes).values())
