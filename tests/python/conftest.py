import pathlib
import sys

# The harness (dist_util) sits next to the tests; the package comes from PYTHONPATH (ctest sets
# it to torch_ext/python) or from an installed wheel.
sys.path.insert(0, str(pathlib.Path(__file__).parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "transformers_5_8: also run against transformers 5.8.0, the newest "
                                       "LlamaFactory allows (ctest pytest_transformers_5_8: -m transformers_5_8)")
    config.addinivalue_line("markers", "parity: a run checked against one process (fsdpturbo.parity); ctest "
                                       "parity_portable and parity_avx2 run these again on those instruction sets")
