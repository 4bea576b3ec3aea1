"""Optional MLflow tracking of the train stage (config tracking.mlflow), against a local file store: params,
per-step metrics and artifacts as train writes them, one run across kill-and-resume, no mlflow import when
off, and no credential in any message, manifest or job command."""
import dataclasses
import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import build_tiny_tokenised, tiny_training_settings
from test_train import REPO, log_rows, subprocess_env, train_argv, train_here, wait_for
from workflow_scripts import train
from workflow_scripts.analysis.fairness import flatten
from workflow_scripts.core.errors import ConfigError, WorkflowError
from workflow_scripts.core.section_settings import MlflowSettings, TrackingSettings
from workflow_scripts.training import trackers

IDENTITY = {"model": "tiny", "dataset": "synthetic", "variant": "baseline", "seed": 1}
SECRET = "s3cr3t-pw"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return build_tiny_tokenised(tmp_path_factory.mktemp("tracked_data"), rows=96, validation_rows=24)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """One local store (a directory) for the module: a new SQLite store takes seconds to create its tables."""
    return tmp_path_factory.mktemp("mlruns")


def tracking_argv(location: str, experiment: str = "tests", enabled: bool = True) -> list[str]:
    mlflow = {"enabled": enabled, "tracking_uri": location, "experiment": experiment}
    return ["--tracking", json.dumps({"mlflow": mlflow, "run": IDENTITY})]


def database(store: Path) -> str:
    return f"sqlite:///{store}/mlflow.db"


def only_run(store: Path, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=database(store))
    experiment = client.get_experiment_by_name(experiment)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_params_metrics_and_artifacts_reach_a_local_store(tmp_path, tiny_model_dir, data_dir, store):
    out = tmp_path / "out"
    settings = tiny_training_settings(max_steps=6, checkpoint_every=100, validation={"every_steps": 3})
    argv = train_argv(out, tiny_model_dir, data_dir, settings) + tracking_argv(str(store), "outputs")
    assert train.main(argv) == 0
    rows, manifest = log_rows(out), json.loads((out / "run_manifest.json").read_text())
    client, run = only_run(store, "outputs")
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny/synthetic/baseline/seed1"
    # Params: the experiment's identity and every resolved training setting (as the manifest records them).
    expected = {key: str(value) for key, value in IDENTITY.items()}
    expected |= {key: value if isinstance(value, str) else json.dumps(value)
                 for key, value in flatten(manifest["settings"], "training").items()}
    assert run.data.params == expected and expected["training.max_steps"] == "6"
    # Metrics: one value per logged step, the same as train_log.jsonl's.
    assert sorted(history(client, run_id, "loss")) == [(r["step"], r["loss"]) for r in rows]
    assert sorted(history(client, run_id, "learning_rate")) == [(r["step"], r["learning_rate"]) for r in rows]
    validation = sorted(history(client, run_id, "validation_loss"))
    assert [step for step, _ in validation] == [3, 6]
    assert validation == [(r["step"], r["validation_loss"]) for r in rows if "validation_loss" in r]
    # Artifacts: the manifest and the log as written, and the adapter directory.
    top = {f.path for f in client.list_artifacts(run_id)}
    assert {"run_manifest.json", "train_log.jsonl", "adapter"} <= top
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= {
        f.path for f in client.list_artifacts(run_id, "adapter")}
    copy = Path(client.download_artifacts(run_id, "run_manifest.json", str(tmp_path)))
    assert copy.read_bytes() == (out / "run_manifest.json").read_bytes()
    assert run.info.artifact_uri.startswith((store / "artifacts").as_uri())  # the store keeps its artifacts
    assert manifest["tracking"] == {"mlflow_run_id": run_id, "mlflow_tracking_uri": database(store)}
    assert not (out / "checkpoints" / trackers.RUN_ID_FILE).exists()  # a forced rerun opens a new run


# The killed job: a fresh interpreter, not a rank forked from this process (tests/ranks.py), which would inherit
# this process's open connections to the same SQLite store (MLflow caches its store).
SLOW_TRAIN = (
    # Slows each micro-step so the test can signal the run mid-way; the training code is unchanged.
    "import sys, time; from workflow_scripts import train; from workflow_scripts.training import training_setup; "
    "from workflow_scripts.core.errors import run_main; step = training_setup.micro_step; "
    "training_setup.micro_step = lambda *a, **k: (time.sleep(0.1), step(*a, **k))[1]; "
    "sys.argv[0] = 'train'; run_main(train.main)"
)


def test_a_killed_run_is_continued_with_each_step_once(tmp_path, tiny_model_dir, data_dir, store):
    out = tmp_path / "out"
    settings = tiny_training_settings(max_steps=10, checkpoint_every=2, lora={"dropout": 0.1})
    argv = train_argv(out, tiny_model_dir, data_dir, settings) + tracking_argv(str(store), "resume")
    process = subprocess.Popen([sys.executable, "-c", SLOW_TRAIN, *argv], cwd=REPO, env=subprocess_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: (out / "checkpoints" / "step-00000004" / "state.json").exists(), process)
    process.send_signal(signal.SIGKILL)  # no chance to close the run, as with an OOM kill
    process.wait()
    client, killed = only_run(store, "resume")
    first_job = [step for step, _ in history(client, killed.info.run_id, "loss")]
    assert killed.info.status == "RUNNING" and first_job == list(range(1, len(first_job) + 1)) and len(first_job) >= 4
    assert (out / "checkpoints" / trackers.RUN_ID_FILE).read_text().strip() == killed.info.run_id

    printed = train_here(argv)  # the requeued job, in this process
    assert "resumed from" in printed and f"run {killed.info.run_id}" in printed
    client, run = only_run(store, "resume")
    assert run.info.run_id == killed.info.run_id and run.info.status == "FINISHED"
    rows = log_rows(out)
    for key in ("loss", "grad_norm", "tokens_per_second"):
        steps = [step for step, _ in history(client, run.info.run_id, key)]
        assert sorted(steps) == list(range(1, 11)), (key, steps)  # every step once: none duplicated or missing
    # Resuming is exact, so the steps the first job logged and the second redid agree with the final log.
    assert sorted(history(client, run.info.run_id, "loss")) == [(r["step"], r["loss"]) for r in rows]


def test_tracking_off_imports_no_mlflow(tmp_path, tiny_model_dir, data_dir):
    assert importlib.util.find_spec("mlflow") is not None, "mlflow-skinny is a test dependency (pip install -e .[test])"
    probe = ("import sys, json; from workflow_scripts import train; code = train.main(sys.argv[1:]); "
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))); sys.exit(code)")
    out = tmp_path / "out"  # as the workflow calls it: --tracking with mlflow.enabled false (the default)
    argv = (train_argv(out, tiny_model_dir, data_dir, tiny_training_settings(max_steps=2))
            + tracking_argv(str(tmp_path / "unused"), enabled=False))
    result = subprocess.run([sys.executable, "-c", probe, *argv], cwd=REPO, env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []
    assert json.loads((out / "run_manifest.json").read_text())["tracking"] is None
    assert not (tmp_path / "unused").exists()


def test_an_unreachable_server_stops_in_one_line_without_the_password(monkeypatch, capsys, tmp_path, tiny_model_dir,
                                                                       data_dir):
    for name, value in {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
                        "MLFLOW_TRACKING_USERNAME": "", "MLFLOW_TRACKING_PASSWORD": ""}.items():
        monkeypatch.setenv(name, value)  # also restores the credentials the tracker moves out of the URI
    uri = f"http://alice:{SECRET}@127.0.0.1:9/mlflow?token={SECRET}x"  # port 9: nothing listens
    argv = train_argv(tmp_path, tiny_model_dir, data_dir, tiny_training_settings(max_steps=2)) + tracking_argv(uri)
    with pytest.raises(WorkflowError) as raised:
        train.main(argv)
    message, printed = str(raised.value), capsys.readouterr()
    assert message.startswith("tracking.mlflow: could not open a run at http://<redacted>@127.0.0.1:9/mlflow")
    assert "\n" not in message and "Fix:" in message
    assert SECRET not in message + printed.out + printed.err
    assert not (tmp_path / "run_manifest.json").exists()


@pytest.mark.parametrize("uri, shown, credentials", [
    ("https://alice:pw%40x@mlflow.example.org:5000/base", "https://<redacted>@mlflow.example.org:5000/base", True),
    ("https://ghp_token@mlflow.example.org", "https://<redacted>@mlflow.example.org", True),
    ("https://mlflow.example.org/api?token=abc&x=1", "https://mlflow.example.org/api?token=<redacted>&x=<redacted>", True),
    ("https://mlflow.example.org/api?workspace=a", "https://mlflow.example.org/api?workspace=<redacted>", False),
    ("http://127.0.0.1:5000", "http://127.0.0.1:5000", False),
    ("file:///data/mlruns", "file:///data/mlruns", False),
])
def test_uris_are_shown_without_credentials(uri, shown, credentials):
    assert trackers.redact_uri(uri) == shown
    assert trackers.has_credentials(uri) is credentials


def test_the_config_refuses_credentials_in_the_uri_and_unknown_run_name_fields():
    tracking = TrackingSettings.from_json(json.dumps({"mlflow": {"enabled": True}}))
    assert tracking.mlflow == MlflowSettings(enabled=True, tracking_uri=None, experiment="lora-experiments",
                                             run_name="{model}/{dataset}/{variant}/seed{seed}")
    trackers.check_workflow_tracking(tracking)
    filled = tracking.with_run("m", "d", "v", 3).to_dict()
    assert filled["mlflow"]["run_name"] == "m/d/v/seed3" and filled["run"] == {"model": "m", "dataset": "d",
                                                                                "variant": "v", "seed": 3}
    assert TrackingSettings.from_json(json.dumps(filled)).to_dict() == filled  # what train receives, unchanged
    with_secret = dataclasses.replace(tracking.mlflow, tracking_uri=f"https://bob:{SECRET}@mlflow.example.org")
    with pytest.raises(ConfigError, match="tracking.mlflow.tracking_uri.*MLFLOW_TRACKING_PASSWORD") as raised:
        trackers.check_workflow_tracking(dataclasses.replace(tracking, mlflow=with_secret))
    assert SECRET not in str(raised.value)
    unknown_field = dataclasses.replace(tracking.mlflow, run_name="{model}-{lr}")
    with pytest.raises(ConfigError, match=r"tracking.mlflow.run_name.*\['lr'\]"):
        trackers.check_workflow_tracking(dataclasses.replace(tracking, mlflow=unknown_field))
    with pytest.raises(ConfigError, match="tracking.mlflow.experiment"):
        TrackingSettings.from_json(json.dumps({"mlflow": {"experiment": ""}}))


@pytest.mark.parametrize("uri", [
    f"https://mlflow.example.org/api?auth={SECRET}&sig=abcdef",  # no secret-looking key name
    f"https://mlflow.example.org/?workspace={SECRET}",
    f"https://{SECRET}@mlflow.example.org",
    f"https://mlflow.example.org/#{SECRET}",
])
def test_the_config_refuses_any_query_or_user_info_in_the_uri(uri):
    """Any of them would be printed with the train command (-p, every 'Error in rule train' block)."""
    tracking = TrackingSettings.from_json(json.dumps({"mlflow": {"enabled": True, "tracking_uri": uri}}))
    with pytest.raises(ConfigError, match="tracking.mlflow.tracking_uri.*MLFLOW_TRACKING_TOKEN.*environment") as raised:
        trackers.check_workflow_tracking(tracking)
    assert SECRET not in str(raised.value)


def test_the_train_rule_passes_the_tracking_block_with_the_run_name(tmp_path):
    from test_dag import absolute_demo_config, config_file
    from test_dry_run_families import dry_run

    config = absolute_demo_config(["chartqa_demo"])
    config["tracking"] = {"mlflow": {"enabled": True, "experiment": "demo"}}
    code, output = dry_run(tmp_path, "-n", "-p", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "1", "--until", "train")
    assert code == 0, output
    assert '"run_name": "tiny-llama/chartqa_demo/baseline/seed1"' in output and '"experiment": "demo"' in output
    config["tracking"]["mlflow"]["tracking_uri"] = f"https://bob:{SECRET}@mlflow.example.org"
    code, output = dry_run(tmp_path, "-n", "--configfile", str(config_file(tmp_path, config)),
                           "--replace-workflow-config", "--cores", "1")
    assert code != 0 and "tracking.mlflow.tracking_uri" in output and SECRET not in output
