import sys

from mixed_worker.main import main

sys.exit(main())
