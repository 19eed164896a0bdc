"""Per-family utilization MLPs over the tile decomposition: fitting, prediction, checkpoints."""

from neusight.predictor.model import Predictor, PredictorConfig

__all__ = ["Predictor", "PredictorConfig"]
