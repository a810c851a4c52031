"""The flight recorder's analysis from the command line (torchrun runs, where no notebook
collects the ranks):

    python -m course_lib.observe.analyse_dumps DIR

reads DIR/rank_<r>.json and prints the analysis, the culprit first
(course_lib.observe.flight_recorder). It is a module of its own because the package imports
flight_recorder (course_lib -> runtime -> recorded): run as `python -m` itself, that module
would be in sys.modules before runpy executes it, and runpy prints a RuntimeWarning ahead of
the answer. Nothing imports this one.
"""

import sys

from course_lib.observe.flight_recorder import main

if __name__ == "__main__":
    sys.exit(main())
