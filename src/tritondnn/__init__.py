"""tritondnn: cuDNN-class deep-learning primitives written in Triton, over PyTorch tensors.

>>> import tritondnn as tdnn
>>> y = tdnn.softmax(x, dim=-1)

Re-exports only; the backend (GPU or Triton's interpreter) is chosen first, before any kernel exists.
"""

from .core.backend import backend  # first: it picks the backend before any kernel is defined
from .core.config import config
from .core.engine import EngineReport, engines
from .core.errors import NotSupportedError
from .graph import Graph, GraphError, Plan, compile_graph
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
from .ops.attention import AttentionGrads, dropout_keep_mask, sdpa, sdpa_backward
from .ops.conv import (
    conv1d,
    conv2d,
    conv3d,
    conv_backward_bias,
    conv_backward_data,
    conv_backward_weight,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
)
from .ops.cross_entropy import cross_entropy
from .ops.ctc import ctc_loss
from .ops.dropout import dropout, dropout_add
from .ops.embedding import embedding
from .ops.epilogue import Epilogue
from .ops.matmul import MatmulOutput, linear, matmul
from .ops.norm import (
    add_layer_norm,
    add_rms_norm,
    batch_norm,
    batch_norm_apply,
    batch_norm_backward_apply,
    batch_norm_backward_reduce,
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
from .ops.reduce import reduce_tensor
from .ops.rnn import gru, lstm, rnn
from .ops.softmax import log_softmax, softmax
from .ops.spatial import affine_grid, grid_sample
from .ops.tensor_ops import op_tensor
from .ops.transform import dequantize_fp8, quantize_fp8, transform_tensor

__version__ = "0.1.0"

__all__ = [
    "AttentionGrads",
    "EngineReport",
    "Epilogue",
    "Graph",
    "GraphError",
    "MatmulOutput",
    "NotSupportedError",
    "Plan",
    "__version__",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "add_layer_norm",
    "add_rms_norm",
    "affine_grid",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "backend",
    "batch_norm",
    "batch_norm_apply",
    "batch_norm_backward_apply",
    "batch_norm_backward_reduce",
    "batch_norm_stats",
    "compile_graph",
    "config",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_backward_bias",
    "conv_backward_data",
    "conv_backward_weight",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "cross_entropy",
    "ctc_loss",
    "dequantize_fp8",
    "dropout",
    "dropout_add",
    "dropout_keep_mask",
    "elu",
    "embedding",
    "engines",
    "gelu",
    "grid_sample",
    "group_norm",
    "gru",
    "instance_norm",
    "interpolate",
    "layer_norm",
    "leaky_relu",
    "linear",
    "local_response_norm",
    "log_softmax",
    "lstm",
    "matmul",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "nn",
    "op_tensor",
    "quantize_fp8",
    "reduce_tensor",
    "relu",
    "rms_norm",
    "rnn",
    "sdpa",
    "sdpa_backward",
    "sigmoid",
    "silu",
    "softmax",
    "softplus",
    "swish",
    "tanh",
    "transform_tensor",
]

# Last: the modules build on the functional ops above.
from . import nn
