import sys

from bench.run import main

sys.exit(1 if main().get("errors") else 0)
