import sys

from common.worker.main import main

sys.exit(main("prefill"))
