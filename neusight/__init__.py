"""neusight: forecast GPU latency of deep-learning inference and training from spec sheets alone."""

from neusight.api import (Prediction, load_predictor, predict, predict_graph, predict_kernel_table, predict_many,
                          rank)
from neusight.devices import Device, list_devices, load_device, modify_device
from neusight.engine import ContinuousForecast, predict_continuous
from neusight.errors import NeuSightError
from neusight.generation import GenerationForecast, predict_generation
from neusight.graph.models import list_models
from neusight.graph.tracer import trace
from neusight.parallel import ParallelPrediction, predict_parallel
from neusight.plan import GenerationPlan, LongestPlan, ParallelPlan, plan_generation, plan_max_seq_len, plan_parallel
from neusight.remedies import Remedy, fit_generation_remedies, fit_remedies
from neusight.serving import ServingCapacity, ServingPlan, plan_serving, serving_capacity

__all__ = ["ContinuousForecast", "Device", "GenerationForecast", "GenerationPlan", "LongestPlan", "NeuSightError",
           "ParallelPlan", "ParallelPrediction", "Prediction", "Remedy", "ServingCapacity", "ServingPlan",
           "fit_generation_remedies", "fit_remedies", "list_devices", "list_models", "load_device", "load_predictor",
           "modify_device", "plan_generation", "plan_max_seq_len", "plan_parallel", "plan_serving", "predict",
           "predict_continuous", "predict_generation", "predict_graph", "predict_kernel_table", "predict_many",
           "predict_parallel", "rank", "serving_capacity", "trace"]
__version__ = "0.1.0"
