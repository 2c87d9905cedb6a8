"""TorchOpt's ``torchopt.transform``: the building blocks its optimisers chain."""

from metadist.compat.torchopt.transform import utils
from metadist.compat.torchopt.transform.basic import (
    add_decayed_weights,
    masked,
    nan_to_num,
    scale,
    scale_by_schedule,
    trace,
)
from metadist.compat.torchopt.transform.scalers import (
    scale_by_accelerated_adam,
    scale_by_adadelta,
    scale_by_adam,
    scale_by_adamax,
    scale_by_radam,
    scale_by_rms,
    scale_by_rss,
    scale_by_stddev,
)

__all__ = ["add_decayed_weights", "masked", "nan_to_num", "scale", "scale_by_accelerated_adam",
           "scale_by_adadelta", "scale_by_adam", "scale_by_adamax", "scale_by_radam",
           "scale_by_rms", "scale_by_rss", "scale_by_schedule", "scale_by_stddev", "trace",
           "utils"]
