"""Run a demo's command line in this process, to check that bad flags are refused.

The refusals happen in the demo's parser, before any rank starts or any group is joined, so they
need no process of their own. A subprocess per refusal cost a torch import each: about 2 s on an
idle 2-core machine, but close to a minute in CI, where the library tests run beside the
notebooks (a 60 s limit killed one that had already printed its error). The torchrun tests
still run every demo as `python -m`.
"""

import contextlib
import importlib
import io
import os
import traceback
from unittest import mock


def run_main(module: str, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit status, stderr) of `python -m <module> <argv>`, run as `main(argv)` here.

    The status follows Python's: argparse's error exits 2, an uncaught exception 1, a returned int
    itself. `env` adds variables (as torchrun would set them) for the call only.
    """
    main = importlib.import_module(module).main
    err = io.StringIO()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stderr(err):
        try:
            code = main(argv) or 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=err)
        except Exception:  # noqa: BLE001 (the subprocess would print it and exit 1)
            traceback.print_exc(file=err)
            code = 1
    return code, err.getvalue()
