"""Exercise 06: pipeline schedules as data. Fill in `one_f_one_b`, then `capped_1f1b` (and, as a
follow-up, `snake_placement`), and run
the check cells of ex06_pipeline_schedule.ipynb. Each check prints PASS when your code is right.

A schedule is, for each rank, the ordered list of actions it runs:

    Action("F", j)   forward of micro-batch j on this rank's stage
    Action("B", j)   backward of micro-batch j on this rank's stage

Rank r holds stage r of p. A rank can run F(j) only after rank r-1 ran F(j) (it needs the
activation), and B(j) only after its own F(j) and rank r+1's B(j) (it needs the gradient);
the last rank starts B(j) right after its F(j). Every rank runs its list strictly in order,
waiting in each receive. A micro-batch is "in flight" on a rank from its F to its B there: the
rank holds its activations all that time.

Write the lists yourself from `Action`: the grader refuses a module that uses the library's
schedule generators.
"""

from course_lib.parallel.pp import Action


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """The 1F1B schedule for p ranks and m micro-batches: a list of p lists of Actions.

    Every rank runs F(j) and B(j) once for each micro-batch j = 0..m-1, forwards in increasing
    j and backwards in increasing j. The lists must never deadlock, must keep at most p - r
    micro-batches in flight on rank r whatever m is, and the step must be no longer than
    GPipe's, (m + p - 1)(t_F + t_B): no rank may wait longer than the pipeline forces it to.
    """
    raise NotImplementedError("exercise 06: write one_f_one_b")


def capped_1f1b(p: int, m: int, caps: list[int]) -> list[list[Action]]:
    """The same 1F1B pattern under a memory cap per rank: rank r may hold at most caps[r]
    micro-batches in flight (caps[r] may be smaller or larger than p - r).

    Same rules as one_f_one_b (every action once, no deadlock), in flight at most caps[r] on
    rank r, and a step as short as the 1F1B pattern allows under these caps. caps that cannot
    be a cap (not one int >= 1 per rank) raise ValueError naming the value, before anything
    is built.
    """
    raise NotImplementedError("exercise 06: write capped_1f1b")


def snake_placement(p: int, v: int) -> list[list[int]]:
    """Follow-up: v chunks per rank (v >= 1). Number the vp stages 0 ... vp-1 in the order a
    micro-batch's forward runs them; return, for each rank r, the stages it holds in increasing
    order.

    Rules: every stage on exactly one rank, v stages per rank; stage 0 (the embedding) on rank 0;
    every pass of the forward goes through every rank once (stages kp ... kp + p - 1, for each
    k < v, sit on p different ranks); and each activation travels at most one rank (stages s and
    s + 1 on the same rank or on neighbouring ranks).
    """
    raise NotImplementedError("exercise 06: write snake_placement")
