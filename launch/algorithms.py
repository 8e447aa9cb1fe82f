"""Every algorithm the application runs, by ``algo.name``: diloco's registry with DeMo in it."""

import demo_optim  # noqa: F401  (registers algo.name=demo)
from diloco import ALGORITHMS, algorithm_class

__all__ = ["ALGORITHMS", "algorithm_class"]
