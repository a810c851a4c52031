"""The flight recorder's analysis (see the package docstring): reads the ranks' dumps, lines the
ranks up by each stuck call's sequence number and names the culprits, the likeliest first.

    analyse(load_dumps(dump_dir))            its first line names the culprit
    python -m course_lib.observe.flight_recorder DIR      the same from the files (main)

What it sees is what the recorder wrote: a call is "issued" while the rank's communication has
not ended. On gloo that is while the Python call runs; on NCCL, whose calls return as soon as
they are queued on the GPU's stream, until the call's Work object or the CUDA event recorded
after it says so (the package docstring): a rank whose NCCL collective never completes is named
stuck in it, although its Python code has moved on.
"""

from __future__ import annotations

import json
import pathlib
import sys


def load_dumps(directory) -> dict[int, list[dict]]:
    """{rank: entries} from the rank_<r>.json files in `directory`."""
    files = sorted(pathlib.Path(directory).glob("rank_*.json"))
    if not files:
        raise ValueError(f"{directory} holds no rank_<r>.json dump")
    dumps = {}
    for f in files:
        data = json.loads(f.read_text())
        dumps[data["rank"]] = data["entries"]
    return dumps


def _where(e) -> str:
    if "group" in e:
        return f"{e['op']} #{e['seq']} on group {e['group']}"
    peer = e["dst"] if e["op"] == "send" else e["src"]
    return f"{e['op']} #{e['seq']} {'to' if e['op'] == 'send' else 'from'} rank {peer}"


def _other_end(e) -> dict:
    """The call a point-to-point entry's peer must make: the send for a recv, the recv for a send."""
    return {**e, "op": "recv" if e["op"] == "send" else "send"}


def _partner(e, entries: list[dict]):
    """The entry among a member's `entries` that must match e (same group and number, or the other
    end of a message); None when the member has not issued it."""
    for f in entries:
        if "group" in e and f.get("group") == e["group"] and f["seq"] == e["seq"]:
            return f
        if "group" not in e and "group" not in f and f["seq"] == e["seq"] and (f["src"], f["dst"]) == (e["src"], e["dst"]) \
                and f["op"] != e["op"]:
            return f
    return None


def _describe(member: int, entries: list[dict]) -> str:
    stuck = [e for e in entries if e["state"] == "issued"]
    if stuck:
        return f"it is in {_where(stuck[0])}"
    if entries:
        return f"its last call: {_where(entries[-1])}, completed"
    return "it made no call"


def _ranks(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _wait(ranks) -> str:
    return f"{_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'}"


def analyse(dumps: dict[int, list[dict]], world_size: int | None = None) -> str:
    """Lines naming the culprits: for each stuck call, the members that never entered it or
    called something else there, with the ranks left waiting; the most likely culprit first
    (module docstring). Ranks missing from `dumps` (no file) are named."""
    world = world_size or max(dumps) + 1
    # Each stuck call asks its members for their call with its number. Earliest in its group's
    # order first (sequence number, then rank), not by clock: clocks of different hosts disagree.
    stuck = sorted(((e["seq"], r, e) for r, entries in dumps.items() for e in entries
                    if e["state"] == "issued"), key=lambda t: (t[0], t[1]))
    found: dict = {}  # (culprit, what it did wrong, the call) -> [the waiting ranks, the call's number, order]
    for seq, rank, e in stuck:
        members = e["group"] if "group" in e else [e["dst"] if e["op"] == "send" else e["src"]]
        for m in members:
            if m == rank:
                continue
            if m not in dumps:
                key = (m, "no dump", _where(e))
            else:
                f = _partner(e, dumps[m])
                if f is None:
                    key = (m, "never", _where(e) + " that" if "group" in e else _where(_other_end(e)) + ", the message")
                elif "group" in e and (f["op"], f["shape"], f["dtype"]) != (e["op"], e["shape"], e["dtype"]):
                    key = (m, f"called {f['op']} {f['shape']} {f['dtype']} #{f['seq']} on group {f['group']}",
                           f"{e['op']} {e['shape']} {e['dtype']}")
                else:
                    continue
            found.setdefault(key, [[], seq, len(found)])[0].append(rank)
    stuck_ranks = {r for _, r, _ in stuck}

    def order(item):
        # The likeliest culprit first: the one most ranks wait for; then the earliest call; then one
        # itself stuck elsewhere (it went to another call: a wrong group, a reordering) before one
        # that finished (it may only have left, its own calls all matched); then discovery order.
        (culprit, _, _), (waiters, seq, n) = item
        return (-len(waiters), seq, culprit not in stuck_ranks, n)

    lines = []
    for (culprit, what, call), (waiters, _, _) in sorted(found.items(), key=order):
        if what == "no dump":
            lines.append(f"rank {culprit} wrote no dump (it finished, died, or never recorded); "
                         f"{_wait(waiters)} for it in {call}")
        elif what == "never":
            verb = "in" if call.endswith(" that") else "for"  # a collective is waited in, a message for
            lines.append(f"rank {culprit} never entered {call} {_wait(waiters)} {verb} "
                         f"({_describe(culprit, dumps[culprit])})")
        else:
            lines.append(f"rank {culprit} {what} where {_wait(waiters)} in {call}")
    missing = sorted(set(range(world)) - set(dumps))
    if not lines:
        lines.append("no divergence found: every stuck call's partners are in the same call "
                     "(a rank may be stuck outside torch.distributed)" if stuck else "no rank is stuck in a call")
    if missing:
        lines.append(f"no dump from rank(s) {', '.join(map(str, missing))}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m course_lib.observe.flight_recorder DIR", file=sys.stderr)
        return 2
    try:
        dumps = load_dumps(args[0])
    except (ValueError, OSError) as e:  # a wrong directory: one line, not a traceback
        print(f"flight_recorder: {e}", file=sys.stderr)
        return 2
    print(analyse(dumps))
    return 0
