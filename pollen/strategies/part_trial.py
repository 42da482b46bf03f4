"""A user's aggregator and server update, tried on a made-up round before
anything starts.

Both are numpy code that runs on the server once a round has replies: one
that returns a dict instead of an `Aggregate`, drops an entry, or raises,
used to be found about 19 s into the run, after Flower and Ray had started
(and is still caught there, by `part_results`, if only real replies show
it). A round of made-up replies costs milliseconds: the run's shared entries
as its model holds them, each client's moved by a small step of its own
(distinct, so that a robust rule can tell them apart), with the metrics the
aggregator asks for. The parts are the run's own, composed from its
settings as the ServerApp composes them, so what they refuse is what the
run would meet.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import MetricRecord

from ..protocol import NUM_EXAMPLES
from .aggregation import ClientUpdate
from .part_results import PartError, checked_aggregate, part_path
from .strategy import Strategy

STEP = 0.01  # how far each made-up client moves its float entries, per client


def round_trial_problem(
    strategy: Strategy, model: Mapping[str, np.ndarray]
) -> str | None:
    """Why the strategy's aggregator or server update cannot finish a round
    of made-up replies to `model` (every entry, as numpy arrays), or None."""
    shared = strategy.shared_keys(model)
    current = {key: model[key] for key in shared}
    updates = [
        made_up_update(client, current, strategy.aggregator.required_metrics)
        for client in range(max(2, strategy.min_updates))
    ]
    said = f"on a made-up round of {len(updates)} replies, before the run starts"
    aggregator = strategy.aggregator
    try:
        result = aggregator(updates, current, strategy.trained_keys(current))
    except Exception as err:  # the user's code: anything ends here
        return f"aggregator {part_path(aggregator)!r} raised {_raised(err)} {said}"
    try:
        aggregate = checked_aggregate(result, current, updates, aggregator)
        strategy.step(model, shared, aggregate)
    except PartError as err:
        return f"{err} ({said})"
    except Exception as err:
        who = part_path(strategy.server_update)
        return f"server update {who!r} raised {_raised(err)} {said}"
    return None


def made_up_update(
    client: int, current: Mapping[str, np.ndarray], metrics: tuple[str, ...]
) -> ClientUpdate:
    """Client `client`'s made-up reply: each float entry moved by
    (client + 1) x `STEP`, each integer one (BatchNorm's counter) by
    `client`, weighted by 10 + client examples, every metric the aggregator
    requires set to 1."""
    arrays = {
        key: (
            (value + (client + 1) * STEP).astype(value.dtype)
            if np.issubdtype(value.dtype, np.floating)
            else value + client
        )
        for key, value in current.items()
    }
    examples = 10.0 + client
    record = MetricRecord({NUM_EXAMPLES: examples, **dict.fromkeys(metrics, 1.0)})
    return ClientUpdate(client, arrays, record, examples)


def _raised(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"
