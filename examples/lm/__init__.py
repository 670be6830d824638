"""A byte-level Llama-style language model trained with FORGE beside
``nn.Dense`` + optax: the model (:mod:`examples.lm.llama`), its data
(:mod:`examples.lm.data`), the training loop (:mod:`examples.lm.train`) and
the main job (``python -m examples.lm.main``)."""
