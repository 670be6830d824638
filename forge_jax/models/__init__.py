"""Models built from ForgeDense (or nn.Dense for the optax baseline)."""

from forge_jax.models.llama import (CONFIGS, PROJECTIONS, Attention, Block,
                                    Llama, LlamaConfig, MLP, RMSNorm,
                                    apply_rope, kernels, make_model,
                                    rope_tables, stack_layers, unstack_layers)
