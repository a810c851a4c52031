"""Exercise 06, reference solution: the 1F1B schedule, 1F1B under a memory cap per rank, and the
snake placement of v chunks per rank."""

from course_lib.parallel.pp import Action


def _pattern(m: int, warmups: list[int]) -> list[list[Action]]:
    """Rank r: warmups[r] forwards; then F(w + k), B(k) in turn while forwards remain; then the
    backwards still owed. In flight on rank r: warmups[r] + 1 (or all m when m is smaller)."""
    schedule = []
    for w in warmups:
        actions = [Action("F", j) for j in range(w)]
        for k in range(m - w):
            actions += [Action("F", w + k), Action("B", k)]
        actions += [Action("B", j) for j in range(m - w, m)]
        schedule.append(actions)
    return schedule


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """The last rank can start B(j) right after its F(j): no warm-up. Each rank before it waits
    one stage longer for the gradient (down and back), so it runs one forward more meanwhile:
    rank r warms up with p - r - 1 forwards (all m if fewer), and holds at most p - r."""
    return _pattern(m, [min(p - r - 1, m) for r in range(p)])


def capped_1f1b(p: int, m: int, caps: list[int]) -> list[list[Action]]:
    """A micro-batch in flight on rank r + 1 (forward done there, backward not) is in flight on
    rank r too: r + 1's forward needed r's, and r's backward needs r + 1's. So rank r + 1 can
    never hold more than rank r, and a warm-up longer than the rank before it deadlocks (it
    waits for a forward that rank r, blocked on a backward, never sends). Each rank therefore
    warms up with the most its own cap and every cap before it allow, and no more than 1F1B's."""
    if not isinstance(caps, (list, tuple)) or len(caps) != p:
        raise ValueError(f"caps={caps!r} must be a list of {p} ints, one per rank")
    for r, c in enumerate(caps):
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"caps[{r}]={c!r} must be an int >= 1: a rank must hold the micro-batch it computes")
    warmups, limit = [], m
    for r in range(p):
        limit = min(limit, caps[r])
        warmups.append(min(limit - 1, p - r - 1, m))
    return _pattern(m, warmups)


def snake_placement(p: int, v: int) -> list[list[int]]:
    """Pass k of the micro-batch's forward runs stages kp ... kp + p - 1 over all p ranks, one
    stage per rank, and must start beside the rank where pass k - 1 ended: so the passes snake,
    down the ranks on even k (stage kp + r on rank r) and back up on odd k (stage kp + r on
    rank p-1-r). Each turn stays on one rank; for v = 2 this is the V."""
    placement = [[] for _ in range(p)]
    for k in range(v):
        for i in range(p):
            placement[i if k % 2 == 0 else p - 1 - i].append(k * p + i)
    return placement
