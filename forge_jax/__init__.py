"""forge_jax: FORGE (Fused On-Register Gradient Elimination) for JAX.

The optimizer step of each linear layer runs inside the backward pass's
weight-gradient GEMM, so weight gradients are never stored.
"""

from forge_jax import nnx
from forge_jax.attention import MultiHeadDotProductAttention, SelfAttention
from forge_jax.clipping import global_norm
from forge_jax.convert import from_dense, to_dense
from forge_jax.layer_context import plain_gradients
from forge_jax.linen import (
  FORGE_COLLECTION,
  ForgeDense,
  ForgeDenseGeneral,
  ForgeEmbed,
  ForgeMemoryWarning,
  wiped_layers,
)
from forge_jax.ops.fused_dense import (
  ForgeVariables,
  FusedDenseSpec,
  forge_dense,
  init_variables,
)
from forge_jax.optax_storage import optax_with_storage
from forge_jax.optimizers import (
  SGD,
  Adagrad,
  Adam,
  ForgeOptimizer,
  Lion,
  RAdam,
  RMSprop,
  adagrad,
  adam,
  adamw,
  lion,
  nadam,
  nadamw,
  radam,
  rmsprop,
  sgd,
)
from forge_jax.scan import scan
from forge_jax.train_state import TrainState

__version__ = "0.1.0"
