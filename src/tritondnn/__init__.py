"""tritondnn: cuDNN-class deep-learning primitives written in Triton, over PyTorch tensors.

>>> import tritondnn as tdnn
>>> y = tdnn.softmax(x, dim=-1)

Re-exports only; the backend (GPU or Triton's interpreter) is chosen first, before any kernel exists.
"""

from .core.backend import backend  # first: it picks the backend before any kernel is defined
from .core.config import config
from .core.engine import EngineReport, engines
from .core.errors import NotSupportedError
from .ops.activation import (
    elu,
    gelu,
    leaky_relu,
    relu,
    sigmoid,
    silu,
    softplus,
    swish,
    tanh,
)
from .ops.epilogue import Epilogue
from .ops.matmul import MatmulOutput, linear, matmul
from .ops.norm import (
    add_layer_norm,
    add_rms_norm,
    batch_norm,
    batch_norm_apply,
    batch_norm_stats,
    group_norm,
    instance_norm,
    layer_norm,
    rms_norm,
)
from .ops.pool import (
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    adaptive_max_pool1d,
    adaptive_max_pool2d,
    adaptive_max_pool3d,
    avg_pool1d,
    avg_pool2d,
    avg_pool3d,
    interpolate,
    local_response_norm,
    max_pool1d,
    max_pool2d,
    max_pool3d,
)
from .ops.softmax import log_softmax, softmax

__version__ = "0.1.0"

__all__ = [
    "EngineReport",
    "Epilogue",
    "MatmulOutput",
    "NotSupportedError",
    "__version__",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "add_layer_norm",
    "add_rms_norm",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "backend",
    "batch_norm",
    "batch_norm_apply",
    "batch_norm_stats",
    "config",
    "elu",
    "engines",
    "gelu",
    "group_norm",
    "instance_norm",
    "interpolate",
    "layer_norm",
    "leaky_relu",
    "linear",
    "local_response_norm",
    "log_softmax",
    "matmul",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "relu",
    "rms_norm",
    "sigmoid",
    "silu",
    "softmax",
    "softplus",
    "swish",
    "tanh",
]
