"""neusight: forecast GPU latency of deep-learning inference and training from spec sheets alone."""

from neusight.errors import NeuSightError
from neusight.graph.tracer import trace

__all__ = ["NeuSightError", "trace"]
__version__ = "0.1.0"
