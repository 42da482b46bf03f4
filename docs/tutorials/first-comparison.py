# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Your first comparison, from Python
#
# This notebook compares FedAvg, FedProx and SCAFFOLD on label-skewed data,
# then trains a model of your own with the best of them. It needs nothing
# but pollen: the data set is scikit-learn's handwritten digits (8x8 images,
# ten classes), and the whole notebook runs in about two minutes on two
# CPU cores.
#
# Every run below is a real Flower federation (`flwr run`, a SuperLink and
# one ClientApp per client in Ray's simulation), exactly what `pollen run`
# starts from the command line; the Python functions hand back its results.

# %%
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import pollen

work = Path(tempfile.mkdtemp(prefix="pollen-tutorial-"))  # yours: results/

# %% [markdown]
# ## Compare three algorithms
#
# Ten clients, each with a label-skewed share of the digits (`partition`
# `niid`: class proportions drawn from a Dirichlet distribution with
# `alpha` 0.3, so most clients see few classes), half of them sampled each
# round. Settings are the run config's keys, written in Python
# (`client_frac` is `client-frac`); `pollen list keys` lists them all.
#
# `pollen.compare` runs one cell per value of the grid, here one per
# `strategy`, on a federation it keeps warm between cells, and writes a
# report.

# %%
skewed = dict(partition="niid", alpha=0.3, num_clients=10, client_frac=0.5, rounds=8)
comparison = pollen.compare(
    {"strategy": ["fedavg", "fedprox", "scaffold"]}, skewed, out=work / "skewed-digits"
)

# %% [markdown]
# The report's table: final and best accuracy of the global model on the
# test set, wall time and traffic (one seed each: add `"seed": [1, 2, 3]`
# to the grid for a mean and a standard deviation).

# %%
comparison.table()

# %%
comparison.plot()

# %% [markdown]
# Every run is a folder of files (settings, per-round history, summary,
# plots, the final model); `comparison.runs` reads them back.

# %%
best = max(comparison.runs, key=lambda run: run.summary["final-accuracy"])
best.settings["strategy"], best.history[-1].accuracy

# %% [markdown]
# ## Plug in your own model
#
# A model is a function of the input shape and the number of classes that
# returns a `torch.nn.Module`, named by its import path. The federation's
# processes import it too, so its module must be importable by them: here
# it is written into a folder that goes on `PYTHONPATH` (an installed
# package works as well).

# %%
(work / "my_nets.py").write_text(textwrap.dedent('''
    from torch import nn


    def wide_mlp(input_shape, num_classes):
        """A perceptron with one hidden layer of 256."""
        c, h, w = input_shape
        return nn.Sequential(
            nn.Flatten(), nn.Linear(c * h * w, 256), nn.ReLU(), nn.Linear(256, num_classes)
        )
'''))
sys.path.insert(0, str(work))  # for this notebook, which checks the settings
os.environ["PYTHONPATH"] = os.pathsep.join(  # for the processes the run starts
    [str(work), *filter(None, [os.environ.get("PYTHONPATH")])]
)

run = pollen.run(
    skewed, strategy=best.settings["strategy"], model="my_nets:wide_mlp",
    output_dir=work / "runs",
)
run

# %%
run.plot()

# %% [markdown]
# `run.history` holds a record per round, `run.to_pandas()` the same as a
# DataFrame (with pandas installed), and `run.model()` the trained global
# model with its weights:

# %%
model = run.model()
model

# %% [markdown]
# Where next: every setting is in the
# [configuration reference](../../configuration/), the functions used here
# in the [Python API reference](../../python-api/), and the same comparison
# from the command line is `pollen compare GRID.toml --out DIR`
# ([usage](../../usage/)).
