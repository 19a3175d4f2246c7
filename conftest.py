# The suite's options and hooks live in an importable plugin (properties/plugin/__init__.py) so that pytest can load
# them from anywhere; registering it by module name here means `-p properties.plugin` never adds it twice.
import os
import sys

pytest_plugins = ["properties.plugin"]


def pytest_configure(config):
    """Under pytest-xdist the workers share the machine's cores: each gets its share of intra-op threads
    (and so do the processes it starts), because OpenMP threads of two workers that wait on each other
    make the small operations of these tests many times slower. Torch reads the variables when it is first
    imported; where the suite's plug-in has imported it already, its thread count is set here."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)

