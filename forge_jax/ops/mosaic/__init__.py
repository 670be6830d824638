"""Pallas kernel (Mosaic GPU, Hopper): wgmma dW tiles with the update fused.

:func:`mosaic_update` is the backend entry point (``backends.xla_update``'s
contract); :func:`unsupported_reason` and :func:`check_supported` say
whether it can run a call, :func:`fills_the_gpu` whether its tiles keep the
GPU busy; :class:`MosaicConfig` is its tiling and schedule,
:func:`default_config` the one it picks.

Modules: :mod:`~forge_jax.ops.mosaic.kernel` (the entry point),
:mod:`~forge_jax.ops.mosaic.config` (configs, their register and
shared-memory budgets, the default ranking),
:mod:`~forge_jax.ops.mosaic.pipeline` (tile streaming and the main loop),
:mod:`~forge_jax.ops.mosaic.epilogue` (the update of a tile's sub-tiles),
one module per schedule (:mod:`~forge_jax.ops.mosaic.inline`,
:mod:`~forge_jax.ops.mosaic.pingpong`) and
:mod:`~forge_jax.ops.mosaic.compat` (lowerings this JAX lacks).
"""

from forge_jax.ops.mosaic.config import (
  INLINE_CONFIGS,
  PINGPONG_CONFIGS,
  QUANTIZED_CONFIGS,
  QUANTIZED_ROLLED_CONFIGS,
  SCHEDULES,
  MosaicConfig,
  default_config,
  ranked_configs,
)
from forge_jax.ops.mosaic.kernel import (
  check_supported,
  fills_the_gpu,
  mosaic_update,
  unsupported_reason,
)

__all__ = [
  "INLINE_CONFIGS",
  "PINGPONG_CONFIGS",
  "QUANTIZED_CONFIGS",
  "QUANTIZED_ROLLED_CONFIGS",
  "SCHEDULES",
  "MosaicConfig",
  "check_supported",
  "default_config",
  "fills_the_gpu",
  "mosaic_update",
  "ranked_configs",
  "unsupported_reason",
]
