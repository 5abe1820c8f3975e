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
from .ops.softmax import log_softmax, softmax

__version__ = "0.1.0"

__all__ = [
    "EngineReport",
    "NotSupportedError",
    "__version__",
    "backend",
    "config",
    "elu",
    "engines",
    "gelu",
    "leaky_relu",
    "log_softmax",
    "relu",
    "sigmoid",
    "silu",
    "softmax",
    "softplus",
    "swish",
    "tanh",
]
