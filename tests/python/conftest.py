import pathlib
import sys

# The harness (dist_util) sits next to the tests; the package comes from PYTHONPATH (ctest sets
# it to torch_ext/python) or from an installed wheel.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
