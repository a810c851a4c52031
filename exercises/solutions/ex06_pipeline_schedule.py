"""Exercise 06, reference solution: the 1F1B schedule as per-rank action lists."""

from course_lib.parallel.pp import Action


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """Rank r: w = min(p - r - 1, m) warm-up forwards (the last rank needs none: its first
    backward can start right after its first forward; each rank before it one more, the time
    the gradient takes to come back); then pairs F(w + k), B(k) while forwards remain; then
    the w backwards still owed. In flight on rank r: at most w + 1 = p - r micro-batches."""
    schedule = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        actions = [Action("F", j) for j in range(warmup)]
        next_b = 0
        for j in range(warmup, m):
            actions.append(Action("F", j))
            actions.append(Action("B", next_b))
            next_b += 1
        actions.extend(Action("B", j) for j in range(next_b, m))
        schedule.append(actions)
    return schedule
