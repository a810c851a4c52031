"""The weight-sync demo with its transfer plan broken on purpose, run under torchrun as a script:

    torchrun --nproc-per-node 4 tests/_weight_sync_mutant.py MUTANT --trainer zero3:dp2 --generator tp:2 --check

MUTANT is "drop-box" (the last box of the busiest pair is never sent: the generator keeps zeros
there) or "wrong-offset" (one box is read one element further along a trainer's flat shard). Every
rank patches plan_transfer the same way before the demo imports it, so the ranks agree on the
broken plan and the transfer completes: only --check can see the damage."""

import sys
from dataclasses import replace

import course_lib.checkpoint.live as live

MUTANT = sys.argv.pop(1)
honest = live.plan_transfer


def broken(src, dst, dtype=live.torch.float32):
    plan = honest(src, dst, dtype)
    pair = max(plan.moves, key=lambda k: len(plan.moves[k]))
    moves = plan.moves[pair]
    if MUTANT == "drop-box":
        assert len(moves) > 1, "the busiest pair must keep a box to send"
        plan.moves[pair] = moves[:-1]
    elif MUTANT == "wrong-offset":
        s = pair[0]
        size = src.buffers[s][0][0]
        i = next(i for i, m in enumerate(moves) if m.src.local is None and m.src.buffer == 0
                 and m.src.pos + m.src.box.volume < size)  # a flat piece with an element after it
        m = moves[i]
        moves[i] = replace(m, src=replace(m.src, pos=m.src.pos + 1))
    else:
        raise SystemExit(f"unknown mutant {MUTANT!r}")
    return plan


live.plan_transfer = broken

from course_lib.demos import weight_sync  # noqa: E402  (after the patch: it imports plan_transfer by name)

sys.exit(weight_sync.main())
