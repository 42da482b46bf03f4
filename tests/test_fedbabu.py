"""FedBABU (Oh et al. 2022): the body trains alone with the classifier frozen
at the common initialisation, and a personal evaluation fine-tunes the
whole model first (`fine-tune-epochs`, also FedAvg-FT), without keeping it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from pollen import client_app
from pollen.protocol import local_entries_key
from pollen.settings import Settings, SettingsError
from pollen.task.fedbabu import FrozenHead, fine_tuned
from pollen.task.local_run import ADAPT_SEED_OFFSET, plain
from pollen.task.models import build_model
from pollen.task.objectives import LocalObjective
from pollen.task.schedule import local_training
from pollen.task.sharing import Sharing
from tests.test_schedule import BODY, HEAD, context, local_run, settings
from tests.test_sharing import message, run_config

pytestmark = pytest.mark.usefixtures("task_identity")


def test_the_preset_freezes_the_head_keeps_it_local_and_fine_tunes() -> None:
    s = Settings.from_run_config({"strategy": "fedbabu"})
    assert (s.sharing, s.freeze_head, s.fine_tune_epochs) == ("fedper", True, 5)
    assert s.personal_eval_every == 1 and s.head_epochs == 0
    assert local_training(s, None) == FrozenHead(plain)
    # FedAvg-FT: fine-tuning alone is evaluated per client too
    ft = Settings.from_run_config({"fine-tune-epochs": 2})
    assert ft.personal_eval_every == 1 and local_training(ft, None) is plain


def test_one_step_moves_the_body_by_its_gradient_and_not_the_head() -> None:
    """One full-batch SGD step (8 examples, batch 8, lr 0.1, no momentum):
    the body moves by -lr times its cross-entropy gradient at the start,
    computed here by autograd with the head fixed; the head does not move,
    and is trainable again afterwards."""
    recorded = local_run(settings(**{"batch-size": 8}))
    run = recorded.run
    start = {k: v.clone() for k, v in run.model.state_dict().items()}
    expected_model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    expected_model.load_state_dict(start)
    loss = nn.functional.cross_entropy(expected_model(run.x), run.y)
    grads = dict(
        zip(BODY, torch.autograd.grad(loss, [expected_model[0].weight,
                                              expected_model[0].bias]), strict=True)
    )  # fmt: skip
    result, _ = FrozenHead(plain)(run, LocalObjective(), context())
    assert result.steps == 1
    [only] = recorded.passes
    assert only.trained == set(BODY)
    after = run.model.state_dict()
    for name in BODY:
        torch.testing.assert_close(after[name], start[name] - 0.1 * grads[name])
    for name in HEAD:
        assert torch.equal(after[name], start[name])
    assert all(p.requires_grad for p in run.model.parameters())


def test_fine_tuning_trains_the_whole_model_for_the_plain_loss() -> None:
    recorded = local_run(settings())
    fine_tuned(recorded.run, 3)
    [only] = recorded.passes
    assert only.trained == {*BODY, *HEAD} and only.epochs == 3
    assert only.seed_offset == ADAPT_SEED_OFFSET
    assert only.objective.regularizer is None and only.objective.sam_rho == 0


def test_rounds_send_the_body_and_keep_the_initial_head() -> None:
    settings = run_config(strategy="fedbabu")
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    sharing = Sharing.of("fedper", model)
    initial_head = model.state_dict()["4.weight"].numpy().copy()
    context = Context(1, 1, {}, RecordDict(), settings)
    sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
    for rnd in (1, 2):
        reply = client_app.train(message("train", sent, 1, rnd), context)
        arrays = reply.content["arrays"]
        assert set(arrays) == set(sharing.shared)
        assert not np.array_equal(arrays["1.weight"].numpy(), sent["1.weight"].numpy())
        head = context.state[local_entries_key(1)]["4.weight"].numpy()
        assert np.array_equal(head, initial_head)
        sent = arrays


def kept_arrays(context: Context) -> dict[str, np.ndarray]:
    """Every array the client keeps in `context.state`, copied."""
    return {
        f"{key}/{name}": array.numpy().copy()
        for key, record in context.state.items()
        if isinstance(record, ArrayRecord)
        for name, array in record.items()
    }


@pytest.mark.parametrize("strategy", ["fedbabu", "fedavg"])
def test_a_personal_evaluation_fine_tunes_and_keeps_nothing(strategy: str) -> None:
    """The same client, model and round evaluated with and without
    fine-tuning: its numbers differ, what it keeps does not change, and
    under FedAvg the fine-tuned model is tested on the global set too (the
    server tests only the untuned one)."""
    results = {}
    for epochs in (0, 3):
        settings = run_config(strategy=strategy, **{"fine-tune-epochs": epochs})
        model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
        sharing = Sharing.of(Settings.from_run_config(settings).sharing_policy, model)
        context = Context(1, 1, {}, RecordDict(), settings)
        sent = ArrayRecord({k: model.state_dict()[k] for k in sharing.shared})
        trained = client_app.train(message("train", sent, 1, 1), context)
        before = kept_arrays(context)
        reply = client_app.evaluate_personal(
            message("evaluate", trained.content["arrays"], 1, 1), context
        )
        after = kept_arrays(context)
        assert before.keys() == after.keys()
        assert all(np.array_equal(before[k], after[k]) for k in before)
        results[epochs] = dict(reply.content["metrics"])
    assert results[0]["local-loss"] != results[3]["local-loss"]
    assert math.isfinite(results[3]["global-accuracy"])
    assert math.isnan(results[0]["global-accuracy"]) == (strategy == "fedavg")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"freeze-head": True}, "set sharing='fedper'"),
        ({"strategy": "fedbabu", "head-epochs": 1}, "freeze-head with head-epochs=1"),
        ({"strategy": "fedbabu", "dp": True, "model": "cnn-gn"},
         "freeze-head with dp=true"),
        ({"fine-tune-epochs": 1, "dp": True, "model": "cnn-gn"},
         "fine-tune-epochs with dp=true"),
        ({"strategy": "ditto", "fine-tune-epochs": 1},
         "fine-tune-epochs with ditto-lambda"),
        ({"strategy": "fedbabu", "client-execution": "cohort"},
         "freeze-head=true"),
        ({"strategy": "fedbabu", "model": "cnn-lora"}, "LoRA head"),
        ({"strategy": "fedbabu", "model": "logreg", "data-set": "synthetic"},
         "its classifier is all it trains"),
        ({"fine-tune-epochs": 2, "personal-eval-every": 0}, "none is asked for"),
    ],
)  # fmt: skip
def test_what_fedbabu_refuses(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config(overrides)
