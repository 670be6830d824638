"""The README's quickstart runs as written, and its step trains."""

import os
import re

import numpy as np

README = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md"
)


def test_quickstart_runs_and_trains():
  with open(README) as f:
    text = f.read()
  quickstart = text[text.index("## Quickstart") :]
  code = re.search(r"```python\n(.*?)```", quickstart, re.S).group(1)
  scope = {}
  exec(compile(code, "README quickstart", "exec"), scope)  # pylint: disable=exec-used
  state, batch = scope["state"], scope["batch"]
  kernel0 = np.array(
    state.params["_overwrite_with_gradient"]["ForgeDense_0"]["kernel"]
  )
  losses = []
  for _ in range(3):
    state, loss = scope["train_step"](state, batch)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  layer = state.params["_overwrite_with_gradient"]["ForgeDense_0"]
  assert np.abs(np.asarray(layer["kernel"]) - kernel0).max() > 0
  assert float(layer["count"]) == 3.0
