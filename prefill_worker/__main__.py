import sys

from prefill_worker.main import main

sys.exit(main())
