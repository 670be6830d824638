"""The quickstart notebook runs top to bottom (its cells assert with chex)."""

import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  "notebooks",
  "quickstart.ipynb",
)


def test_quickstart_notebook_executes():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(
    notebook, timeout=600, kernel_name="python3"
  ).execute()
  outputs = "".join(
    out.get("text", "")
    for cell in notebook.cells
    if cell.cell_type == "code"
    for out in cell.get("outputs", [])
  )
  assert "weights, moments and biases match" in outputs
  errors = [
    out
    for cell in notebook.cells
    if cell.cell_type == "code"
    for out in cell.get("outputs", [])
    if out.get("output_type") == "error"
  ]
  assert not errors, errors
