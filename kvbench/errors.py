"""User-facing errors: bad input is reported as one line and exit code 2, never a traceback."""
from __future__ import annotations

import os
import sys


class UserError(Exception):
    """Bad input from the user (unknown choice, invalid value, missing file or dataset)."""


def run_cli(main):
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        main()
    except Exception as ex:
        import traceback
        print("TYPE", type(ex), type(ex).__mro__, "CAUSE", type(ex.__cause__), repr(ex.__cause__), file=sys.stderr)
        print("ATTRS", {k: v for k, v in vars(ex).items()} , file=sys.stderr)
        print("MSG", str(ex), file=sys.stderr)
        raise SystemExit(2)
