"""`python -m planner` = `kvferry planner`."""

from __future__ import annotations

import sys

from planner.main import main

if __name__ == "__main__":
    sys.exit(main())
