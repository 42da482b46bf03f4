"""`tracker = "mlflow"`: a run as an MLflow run, on a tracking server or store.

The run joins the experiment `tracking-experiment` names ('pollen' by
default; `pollen compare` names it after the comparison's directory, so its
cells sit side by side in the MLflow UI) under the run's name. Its settings
are the MLflow run's params; every round's numbers (`results.round_scalars`)
are metrics with the round as the step; at the end the run's files (plots,
history, summary, settings and the final global model's state dict
`model.pt`) are artefacts, and the MLflow run ends FINISHED, FAILED or
KILLED (interrupted) as the run did.

`<run>/mlflow.json` records the tracking URI and run id: a resumed run
continues the same MLflow run, logging from the round after the last one
MLflow holds (replayed rounds are not logged twice); a setting a resume
changed (e.g. `rounds`) is a `resumed.<key>` tag, since MLflow params never
change. Where the resume logs elsewhere (another URI), it starts a new
MLflow run holding the restored rounds too.

MLflow's usage telemetry is off unless `MLFLOW_DISABLE_TELEMETRY` says
otherwise (without network access it stalls every client for 40 s), and
its client gives up on a request after 2 retries of 10 s at most
(`MLFLOW_HTTP_REQUEST_MAX_RETRIES`, `..._TIMEOUT`; MLflow's own defaults
retry for minutes). Logging is a side channel: if the tracking server
cannot be reached when the run starts or stops answering mid-run, pollen
says so once and trains on; the run's own files stay complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..files import write_json
from ..settings import Settings
from .results import RoundRecord, round_scalars

RUN_FILE = "mlflow.json"
URI_ENV = "MLFLOW_TRACKING_URI"
CLIENT_ENV = {  # unless the environment says otherwise
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
DEFAULT_EXPERIMENT = "pollen"
STATUS = {"completed": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch
HEALTH_TIMEOUT = 3.0


def tracking_uri(settings: Settings) -> str:
    """Where the run logs: `tracking-uri`, else (a resumed run) the store it
    logged to before, else `$MLFLOW_TRACKING_URI`, else an SQLite store
    beside the runs (`<output-dir>/mlflow.db`, absolute)."""
    if settings.tracking_uri:
        return settings.tracking_uri
    if settings.resume:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return json.loads((Path(settings.resume) / RUN_FILE).read_text())[
                "tracking-uri"
            ]
    if os.environ.get(URI_ENV):
        return os.environ[URI_ENV]
    return "sqlite:///" + str(Path(settings.output_dir).resolve() / "mlflow.db")


def pin_uri(uri: str) -> str:
    """`uri` with a relative SQLite path made absolute against this directory
    (the ServerApp runs elsewhere); other URIs unchanged."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def check_server(uri: str) -> None:
    """Raise ValueError unless the tracking server at http(s) `uri` answers
    its health check now (MLflow's client would retry for minutes)."""
    if not uri.startswith(("http://", "https://")):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT) as reply:
            reply.read()
    except urllib.error.HTTPError:  # a server answers (behind a proxy, say)
        return
    except OSError as err:  # URLError included: nothing answers
        reason = getattr(err, "reason", err)
        raise ValueError(
            f"no MLflow tracking server answers at {uri} ({reason}); start one "
            "(mlflow server --port 5000) or leave tracking-uri empty for an "
            "SQLite store beside the runs"
        ) from None


class MlflowTracker:
    """One MLflow run per pollen run, through MLflow's client (no global
    active run: the ServerApp may share its process with other runs)."""

    def __init__(
        self,
        settings: Settings,
        run_dir: Path,
        run_name: str,
        restored: Sequence[RoundRecord],
    ) -> None:
        # MLflow's usage telemetry would wait on the network where there is none;
        # its client would retry a dead server for minutes while a round waits
        for name, value in CLIENT_ENV.items():
            os.environ.setdefault(name, value)
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise RuntimeError(
                "tracker='mlflow' needs the mlflow package: "
                "pip install 'pollen-fl[mlflow]'"
            ) from err
        # the store's schema set-up and SQLAlchemy's deprecations are MLflow's
        # business, not lines of the run's console
        for logger in ("mlflow.store.db.utils", "alembic"):
            logging.getLogger(logger).setLevel(logging.WARNING)
        warnings.filterwarnings(
            "ignore", category=DeprecationWarning, module=r"mlflow\."
        )
        self.uri = tracking_uri(settings)
        self.run_id = ""
        self.logged_to = 0
        self.client: Any = None
        try:  # a store MLflow cannot open (a database driver missing) fails here
            self.client = MlflowClient(tracking_uri=self.uri)
        except Exception as err:
            self._stopped(err)
        self._call(self._open, settings, run_dir, run_name, bool(restored))
        if self.client is None:
            return
        print(f"pollen: MLflow run {self.run_id} at {self.uri}", flush=True)
        for record in restored:
            self.round(record)

    def _open(
        self, settings: Settings, run_dir: Path, run_name: str, resumed: bool
    ) -> None:
        """Continue the MLflow run a resumed run logged to, or start one."""
        config = {k: str(v) for k, v in settings.to_run_config().items()}
        self.run_id = (self._continued(run_dir, config) if resumed else None) or ""
        if not self.run_id:
            self.run_id = self._create(settings, run_dir, run_name, config)
            record = {"tracking-uri": self.uri, "run-id": self.run_id}
            write_json(run_dir / RUN_FILE, record)
        self.logged_to = self._last_step()

    def _continued(self, run_dir: Path, config: dict[str, str]) -> str | None:
        """The MLflow run a resumed run continues (None: start another), marked
        running again, with the settings the resume changed as tags."""
        from mlflow.exceptions import MlflowException

        try:
            recorded = json.loads((run_dir / RUN_FILE).read_text())
            if recorded["tracking-uri"] != self.uri:
                return None
            run = self.client.get_run(recorded["run-id"])
        except (OSError, ValueError, KeyError, MlflowException):
            return None
        if run.info.lifecycle_stage != "active":  # deleted in the UI
            return None
        changed = {
            f"resumed.{key}": value
            for key, value in config.items()
            if run.data.params.get(key, value) != value
        }
        for tag, value in changed.items():
            self.client.set_tag(run.info.run_id, tag, value)
        self.client.update_run(run.info.run_id, status="RUNNING")
        return run.info.run_id

    def _create(
        self, settings: Settings, run_dir: Path, run_name: str, config: dict[str, str]
    ) -> str:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        name = settings.tracking_experiment or DEFAULT_EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(
                    name, artifact_location=self._artifact_location(name)
                )
            except MlflowException:  # another run created it a moment ago
                experiment_id = self.client.get_experiment_by_name(name).experiment_id
        run = self.client.create_run(
            experiment_id, run_name=run_name,
            tags={"pollen.run-dir": str(run_dir), "pollen.strategy": settings.strategy,
                  "pollen.data-set": settings.data_set},
        )  # fmt: skip
        params = [Param(key, value) for key, value in config.items()]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(
                run.info.run_id, params=params[start : start + PARAMS_PER_BATCH]
            )
        return run.info.run_id

    def _artifact_location(self, experiment: str) -> str | None:
        """Beside an SQLite store, its artefacts (MLflow's default is `./mlruns`
        of whichever process creates the experiment); a server chooses its own."""
        prefix = "sqlite:///"
        if not self.uri.startswith(prefix):
            return None
        store = Path(self.uri[len(prefix) :]).parent
        return (store / "mlartifacts" / experiment).as_uri()

    def _last_step(self) -> int:
        history = self.client.get_metric_history(self.run_id, "accuracy")
        return max((metric.step for metric in history), default=0)

    def round(self, record: RoundRecord) -> None:
        from mlflow.entities import Metric

        if self.client is None or record.round <= self.logged_to:
            return
        now = int(time.time() * 1000)
        metrics = [
            Metric(name, value, now, record.round)
            for name, value in round_scalars(record).items()
        ]
        self._call(self.client.log_batch, self.run_id, metrics=metrics)
        self.logged_to = record.round

    def finish(self, run_dir: Path, status: str) -> None:
        if self.client is None:
            return
        for path in sorted(run_dir.iterdir()):
            if path.is_file() and path.name != RUN_FILE:
                self._call(self.client.log_artifact, self.run_id, str(path))
        self._call(self.client.set_terminated, self.run_id, STATUS[status])

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> None:
        """`method(*args, **kwargs)`; on the first failure, say so and stop
        logging: the run goes on, its own files are complete."""
        if self.client is None:
            return
        try:
            method(*args, **kwargs)
        except Exception as err:
            self._stopped(err)

    def _stopped(self, err: Exception) -> None:
        """Say once that logging stopped on `err`, and log nothing more."""
        print(
            f"pollen: MLflow logging at {self.uri} stopped ({type(err).__name__}: "
            f"{err}); the run goes on and its own files are complete",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        self.client = None
