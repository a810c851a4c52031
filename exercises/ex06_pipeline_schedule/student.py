"""Exercise 06: the 1F1B pipeline schedule, as data. Fill in `one_f_one_b`, then run the
check cells of ex06_pipeline_schedule.ipynb. Each check prints PASS when your code is right.

A schedule is, for each rank, the ordered list of actions it runs:

    Action("F", j)   forward of micro-batch j on this rank's stage
    Action("B", j)   backward of micro-batch j on this rank's stage

Rank r holds stage r of p. A rank can run F(j) only after rank r-1 ran F(j) (it needs the
activation), and B(j) only after its own F(j) and rank r+1's B(j) (it needs the gradient);
the last rank starts B(j) right after its F(j). Every rank runs its list strictly in order,
waiting in each receive.
"""

from course_lib.parallel.pp import Action


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """The 1F1B schedule for p ranks and m micro-batches: a list of p lists of Actions.

    Every rank runs F(j) and B(j) once for each micro-batch j = 0..m-1, forwards and backwards
    each in increasing j. The schedule must never deadlock, must keep at most p - r
    micro-batches in flight on rank r (forward done, backward not yet), whatever m is, and
    must keep GPipe's bubble (p-1)/(m+p-1): no rank may wait longer than it has to.

    Plan it in three phases per rank: some warm-up forwards, a steady phase alternating one
    forward and one backward, and a drain of the remaining backwards. How many warm-up
    forwards does rank r need so that its first backward arrives just as it is needed?
    What happens when m is smaller than that number?
    """
    raise NotImplementedError("exercise 06: write one_f_one_b")
