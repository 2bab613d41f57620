"""`python -m router` = `kvferry router`."""

from __future__ import annotations

import sys

from router.main import main

if __name__ == "__main__":
    sys.exit(main())
