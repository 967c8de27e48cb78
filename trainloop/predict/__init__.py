"""Predict runs: ``predict_step`` over the predict data, every item once, in dataset order, in one file.

``trainer.predict()`` and ``trainloop predict`` run the machine ``building -> restoring ->
predicting -> exiting``. The modules: ``outputs`` (what ``predict_step`` may return, kept per
batch), ``order`` (each item's dataset index, from the loader's sampler), ``files`` (the
``.safetensors`` or ``.pt`` file) and ``run`` (the work of ``predicting``); the gathering across
ranks is ``trainloop.distributed.gather``'s.
"""

from trainloop.distributed.gather import GatherError
from trainloop.predict.files import DEFAULT_NAME, PredictionsFileError
from trainloop.predict.order import PredictDataError
from trainloop.predict.outputs import PREDICTIONS_KEY, PredictionError

__all__ = [
    "DEFAULT_NAME", "PREDICTIONS_KEY", "GatherError", "PredictDataError", "PredictionError", "PredictionsFileError"
]
