"""Optional experiment trackers for the train stage: MLflow (off by default), a sink of TrainingLog.

The settings travel as their own ``--tracking`` argument, never inside ``--training``: a tracker changes
nothing that is learned, so it is part neither of the resume fingerprint nor of the fairness comparison.
mlflow is imported only when a tracker is switched on, and only the main rank logs.

A resumed job continues the run whose id the first job left in ``<checkpoint dir>/mlflow_run_id``. Steps
the store already holds are not sent again (a resumed run redoes them with the same values); steps the
store missed but the running log kept are sent on resuming, so the run has each step exactly once.
Credentials never reach a message, a manifest or a parameter: a password in the URI is moved into
MLFLOW_TRACKING_USERNAME/PASSWORD for mlflow's own use and the URI is shown redacted.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import string
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.core.run_manifest import is_secret_key, redact
from workflow_scripts.core.section_settings import MlflowSettings, TrackingSettings

RUN_ID_FILE = "mlflow_run_id"
# A local store: a directory holding mlflow.db (SQLite: mlflow 3 refuses new file stores by default) and
# artifacts/. Relative to the working directory (Snakemake's --directory).
DEFAULT_STORE = "results/mlruns"
RUN_NAME_FIELDS = ("model", "dataset", "variant", "seed")
REDACTED = "<redacted>"
PARAMS_PER_BATCH = 100  # mlflow's limit for one log_batch call
CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def redact_uri(uri: str) -> str:
    """The URI without credentials: user info and every query value become <redacted>, a fragment is dropped."""
    parts = urlsplit(uri)
    netloc = parts.netloc
    if "@" not in netloc and not parts.query and not parts.fragment:
        return uri  # (urlunsplit would turn sqlite:///x.db into sqlite:/x.db)
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = "&".join(f"{item.split('=', 1)[0]}={REDACTED}" for item in parts.query.split("&") if item)
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def has_credentials(uri: str) -> bool:
    """User info (a password, or a token as the user name) or a secret-looking query key, e.g. ?token=."""
    parts = urlsplit(uri)
    keys = [item.split("=", 1)[0] for item in parts.query.split("&") if item]
    return "@" in parts.netloc or any(is_secret_key(key) for key in keys)


def uri_secrets(uri: str) -> list[str]:
    """What of a URI must not be shown: the whole URI when it carries credentials, its user info and password,
    and its query values (a request URL built on it may quote them)."""
    parts = urlsplit(uri)
    userinfo = parts.netloc.rpartition("@")[0]
    password = userinfo.partition(":")[2]
    values = [item.split("=", 1)[1] for item in parts.query.split("&") if "=" in item]
    found = [uri if has_credentials(uri) else "", userinfo, password, *values]
    return [text for secret in found for text in {secret, unquote(secret)} if len(text) >= 4]


def one_line(text: str, secrets: Sequence[str], limit: int = 400) -> str:
    """An error text as one line without any of ``secrets`` (mlflow's messages may quote URIs or headers)."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def check_workflow_tracking(tracking: TrackingSettings) -> None:
    """Config checks for the Snakefile: a usable run name and no credentials in the URI."""
    settings = tracking.mlflow
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(settings.run_name) if name is not None}
    except ValueError as error:
        raise ConfigError("tracking.mlflow.run_name", f"{error}; write {{{{ and }}}} for literal braces") from None
    if fields - set(RUN_NAME_FIELDS):
        raise ConfigError("tracking.mlflow.run_name", f"unknown fields {sorted(fields - set(RUN_NAME_FIELDS))}; "
                          "use {model}, {dataset}, {variant} and {seed}")
    uri = settings.tracking_uri
    # Snakemake prints each job's command and keeps it in .snakemake/metadata. Any user info or query
    # parameter is refused, not only secret-looking ones: ?auth=...&sig=... is a credential by another name.
    parts = urlsplit(uri) if uri else None
    if parts and ("@" in parts.netloc or parts.query or parts.fragment):
        what = "user info" if "@" in parts.netloc else "a query string" if parts.query else "a fragment"
        raise ConfigError("tracking.mlflow.tracking_uri", f"{redact_uri(uri)} carries {what}, which may be "
                          "credentials and would be printed with the job's command; give the URI without them "
                          "and export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                          "MLFLOW_TRACKING_TOKEN) in the environment instead")


def flat_params(training: Mapping[str, Any], identity: Mapping[str, Any]) -> dict[str, str]:
    """MLflow parameters: the experiment's identity and the resolved training settings as dotted keys."""
    from workflow_scripts.analysis.fairness import flatten

    values = {**identity, **flatten(redact(dict(training)), "training")}
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in values.items()}


def _move_credentials_to_environment(uri: str) -> str:
    """A password in the URI goes to mlflow's own variables, so mlflow never quotes it back."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    if password:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
    return urlunsplit(parts._replace(netloc=host))


def store_uri(location: str | None) -> str:
    """A tracking URI: a plain path (or null: results/mlruns) is a local store directory."""
    location = location or DEFAULT_STORE
    if urlsplit(location).scheme:
        return location
    return f"sqlite:///{Path(location).resolve() / 'mlflow.db'}"


def local_store_dir(uri: str) -> Path | None:
    """The directory of a local SQLite database or file store; None for a server."""
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).parent
    if urlsplit(uri).scheme == "file":
        from mlflow.utils.file_utils import local_file_uri_to_path

        return Path(local_file_uri_to_path(uri))
    return None


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """Parallel jobs must not create a local store's tables or one experiment twice: one at a time."""
    root = local_store_dir(uri)
    if root is None:
        yield
        return
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def is_enabled(tracking: TrackingSettings | None) -> bool:
    """Whether the settings switch a tracker on (the same answer on every rank; only rank 0 opens it)."""
    return tracking is not None and tracking.mlflow.enabled


def open_tracker(tracking: TrackingSettings | None, checkpoint_dir: str | Path, resume_step: int,
                 training: Mapping[str, Any], seed: int, model_dir: str, enabled: bool = True,
                 messages: Callable[[str], None] = print) -> "MlflowTracker | None":
    """The MLflow run of this job, opened (or continued) before any step; None when tracking is off."""
    if not enabled or not is_enabled(tracking):
        return None
    settings = tracking.mlflow
    uri = store_uri(tracking.mlflow.tracking_uri)
    shown = redact_uri(uri)
    secrets = uri_secrets(uri)
    identity = {"model": Path(model_dir).name, **tracking.run, "seed": seed}
    with contextlib.suppress(KeyError, IndexError, ValueError):  # the workflow fills it; a direct call, if it can
        settings = dataclasses.replace(settings, run_name=settings.run_name.format(**identity))
    try:
        return MlflowTracker(_move_credentials_to_environment(uri), shown, settings, checkpoint_dir, resume_step,
                             flat_params(training, identity), messages, secrets)
    except WorkflowError:
        raise
    except Exception as error:  # mlflow raises its own, requests' and OS errors alike
        secrets += [os.environ.get(v, "") for v in CREDENTIAL_VARIABLES]
        raise WorkflowError(
            f"tracking.mlflow: could not open a run at {shown} (experiment '{settings.experiment}'): "
            f"{type(error).__name__}: {one_line(str(error), secrets)}. Fix: start the tracking server or correct "
            "tracking.mlflow.tracking_uri, or set tracking.mlflow.enabled: false") from None


class MlflowTracker:
    def __init__(self, uri: str, shown_uri: str, settings: MlflowSettings, checkpoint_dir: str | Path,
                 resume_step: int, params: Mapping[str, str], messages: Callable[[str], None],
                 secrets: Sequence[str] = ()):
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.shown_uri, self.messages, self.secrets = shown_uri, messages, list(secrets)
        self.client = MlflowClient(tracking_uri=uri)
        self.id_file = Path(checkpoint_dir, RUN_ID_FILE)
        self.closed, self.failed = False, False
        with _store_lock(uri):  # (a new SQLite store creates its tables on the first query)
            previous = self.id_file.read_text().strip() if self.id_file.is_file() else ""
            self.run_id = self._resumable_run(previous) if previous and resume_step > 0 else None
            if previous and self.run_id is None and resume_step > 0:
                messages(f"MLflow run {previous} (from {self.id_file}) is not in {shown_uri}; opening a new run")
            elif previous and resume_step == 0:  # a job killed before its first checkpoint: this one starts afresh
                with contextlib.suppress(MlflowException):
                    self.client.set_terminated(previous, "KILLED")
            if self.run_id is None:
                experiment = self.client.get_experiment_by_name(settings.experiment)
                root = local_store_dir(uri) if uri.startswith("sqlite:") else None  # else mlflow's ./mlruns
                experiment_id = (experiment.experiment_id if experiment is not None else self.client.create_experiment(
                    settings.experiment, artifact_location=(root / "artifacts").as_uri() if root else None))
                self.run_id = self.client.create_run(experiment_id, run_name=settings.run_name).info.run_id
                self.id_file.parent.mkdir(parents=True, exist_ok=True)
                self.id_file.write_text(self.run_id + "\n")
            else:
                self.client.update_run(self.run_id, status="RUNNING")
        # Per metric, the last step the store holds (a kill may fall between two metrics of one step).
        self.last_logged = {key: max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=0)
                            for key in self.client.get_run(self.run_id).data.metrics}
        self._log_params(params)
        messages(f"MLflow: run {self.run_id} ('{settings.run_name}') in {shown_uri}"
                 + (f", continued at step {resume_step}" if resume_step and previous == self.run_id else ""))

    def _resumable_run(self, run_id: str) -> str | None:
        """The run a preempted job left, if the store still has it (not deleted)."""
        from mlflow.exceptions import MlflowException

        try:
            return run_id if self.client.get_run(run_id).info.lifecycle_stage == "active" else None
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return None

    def _log_params(self, params: Mapping[str, str]) -> None:
        """Parameters are immutable in MLflow: a resumed job adds missing ones and keeps the first job's values."""
        from mlflow.entities import Param

        stored = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in stored and stored[k] != v)
        if changed:  # only runtime settings can differ here: the resume fingerprint covers the rest
            self.messages(f"MLflow keeps the first job's values of {', '.join(changed)}")
        new = [Param(k, v) for k, v in sorted(params.items()) if k not in stored]
        for start in range(0, len(new), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start:start + PARAMS_PER_BATCH])

    def catch_up(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Send the running log's records (steps the resumed checkpoint covers) that the store lacks."""
        for record in records:
            self.log_step(record)

    def log_step(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(record["step"])
        stamp = int(time.time() * 1000)
        metrics = [Metric(key, float(value), stamp, step) for key, value in sorted(record.items())
                   if key != "step" and isinstance(value, (int, float)) and step > self.last_logged.get(key, 0)]
        if metrics and self._guarded(lambda: self.client.log_batch(self.run_id, metrics=metrics),
                                     f"metrics of step {step}"):
            self.last_logged.update((metric.key, step) for metric in metrics)

    def log_outputs(self, manifest: str | Path, train_log: str | Path, adapter_dir: str | Path) -> None:
        """The finished job's outputs as artifacts; the run ends FINISHED and nothing is left to continue."""
        self._guarded(lambda: (self.client.log_artifact(self.run_id, str(manifest)),
                               self.client.log_artifact(self.run_id, str(train_log)),
                               self.client.log_artifacts(self.run_id, str(adapter_dir), "adapter")), "artifacts")
        self.close("FINISHED")
        self.id_file.unlink(missing_ok=True)

    def manifest_entry(self) -> dict:
        return {"mlflow_run_id": self.run_id, "mlflow_tracking_uri": self.shown_uri}

    def close(self, status: str) -> None:
        """End the run: FINISHED, FAILED, or KILLED for a preempted job (its resumption sets it RUNNING again)."""
        if not self.closed:
            self.closed, self.failed = True, False  # worth one try even after a failed upload
            self._guarded(lambda: self.client.set_terminated(self.run_id, status), f"the run's status {status}")

    def _guarded(self, call: Callable[[], Any], what: str) -> bool:
        """Losing the tracker mid-run must not lose the training: warn once and go on without it."""
        if self.failed:
            return False
        try:
            call()
            return True
        except Exception as error:
            self.failed = True
            secrets = self.secrets + [os.environ.get(v, "") for v in CREDENTIAL_VARIABLES]
            self.messages(f"warning: MLflow at {self.shown_uri} did not take {what} ({type(error).__name__}: "
                          f"{one_line(str(error), secrets)}); the job goes on without it: train_log.jsonl "
                          "and TensorBoard hold every step")
            return False
