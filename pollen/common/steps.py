"""Effective local steps a_k: how far a client's update reaches, for FedNova.

FedNova (Wang et al., 2020, https://arxiv.org/abs/2007.07481, eq. 6) divides
each client's update by its a_k before averaging. The client reports a_k of
the steps it took (`client_app`), the server's aggregation divides by it
(`strategies/fednova.py`), and SCAFFOLD's client control variate normalises
by the same sum under momentum (`task/objectives.py`).
"""

from __future__ import annotations


def effective_steps(steps: int, lr: float, momentum: float, pull: float) -> float:
    """a_k of `steps` SGD steps with heavy-ball `momentum` (PyTorch's: m <-
    rho m + g, y <- y - lr m) and a gradient term pull x (y - x_received):
    the update's coefficient sum, -u_tau / lr, when every gradient is 1."""
    offset = velocity = 0.0
    for _ in range(steps):
        velocity = momentum * velocity + 1.0 + pull * offset
        offset -= lr * velocity
    return -offset / lr
