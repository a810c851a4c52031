"""The flight recorder's analysis from the command line (torchrun runs, where no notebook
collects the ranks):

    python -m course_lib.observe.flight_recorder DIR

reads DIR/rank_<r>.json and prints the analysis, the culprit first. flight_recorder is a package
with this __main__ so that `python -m` runs a module nothing has imported: the package itself is
imported by course_lib (course_lib -> runtime -> recorded), and runpy warns (a RuntimeWarning
ahead of the answer) when the module it runs as __main__ is already in sys.modules.
"""

import sys

from course_lib.observe.flight_recorder import main

sys.exit(main())
