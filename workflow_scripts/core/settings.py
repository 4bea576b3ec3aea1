"""Typed training settings: the config's ``training`` section (with a model's and a variant's overrides
merged in) validated once into frozen dataclasses that the gate, training, the memory estimates and the
Snakefile's resource functions read by attribute.

One function, :meth:`TrainingSettings.parse`, does all the checking: config/schema.yaml's
``training_settings`` (filling its defaults), then what no schema can state (the effective batch splits
evenly over processes, exactly one of max_steps and epochs, warm-up shorter than training, early stopping
and keep: best only with validation, packing only with several examples per micro-batch, a token budget
per micro-batch of at least max_length). The Snakefile parses every (model, variant)
when the workflow is read; a stage parses its ``--training`` JSON the same way, so a stage run by hand
gets the same defaults and the same refusals.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from workflow_scripts.core import fsdp_mesh
from workflow_scripts.core.errors import ConfigError, WorkflowError


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: float = 32
    dropout: float = 0.05
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    modules_to_save: tuple[str, ...] = ()
    train_projector: bool = False  # vision_language: the image projector trained whole, saved with the adapter
    train_vision_tower: bool = False  # vision_language: LoRA on the vision tower too


@dataclass(frozen=True)
class ValidationSettings:
    every_steps: int | None = None
    max_examples: int | None = None
    keep: str = "final"  # final | best
    early_stopping_patience: int | None = None
    # No schema defaults for these two (so the JSON of runs that leave them out stays as it was and
    # Snakemake reruns nothing); their meaning when absent is here.
    metric_examples: int | None = None
    criterion: str = "loss"  # loss | metric


@dataclass(frozen=True)
class QuantizationSettings:
    """QLoRA (bitsandbytes); the schema gives no defaults under a nullable mapping, so they are here."""
    bits: int = 4
    type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str | None = None  # None: training.precision


@dataclass(frozen=True)
class TrainingSettings:
    lora: LoraSettings
    validation: ValidationSettings
    quantization: QuantizationSettings | None
    finetune: str  # lora | full
    max_length: int
    effective_batch: int
    micro_batch: int
    max_steps: int | None
    epochs: float | None
    learning_rate: float
    lr_scheduler: str
    warmup_steps: int
    weight_decay: float
    precision: str  # fp32 | bf16 | fp16
    gradient_checkpointing: bool
    max_grad_norm: float
    checkpoint_every: int
    log_every: int
    gpus: int
    cpu_processes: int
    nodes: int
    strategy: str  # ddp | fsdp
    dataloader_workers: int
    length_grouping: bool
    packing: bool
    sanity_batches: int
    memory_headroom: float
    runtime_minutes: int
    mem_mb: int
    signal_grace_seconds: int  # torchrun's --shutdown-timeout: the checkpoint's time after a signal
    # Speed switches (training/kernels.py). No schema defaults (as validation.metric_examples): the
    # settings JSON of runs that leave them out stays as it was, so Snakemake reruns nothing.
    flex_attention: bool = False
    fused_cross_entropy: bool = False
    liger_kernels: bool = False
    compile_layers: bool = False
    activation_offloading: bool = False
    fsdp_mesh: str | None = None  # hybrid | flat; unset resolves in core/fsdp_mesh.py (no schema default)
    # Token slots per micro-batch (data/batching.py's budget split); None: micro_batch examples. No schema default.
    micro_batch_tokens: int | None = None

    @classmethod
    def parse(cls, value: Any, key: str = "training", source: str | None = None,
              batch_key: str | None = None) -> "TrainingSettings":
        """Validate resolved training settings (a mapping as in the config) and type them.

        ``key`` prefixes the keys named in messages (e.g. ``variants.mtup.training``); ``batch_key`` is
        where the batch shape was set, named when the effective batch does not split (default ``key``).
        """
        if not isinstance(value, Mapping):
            raise ConfigError(key, "must be a mapping of training settings", source)
        checked = copy.deepcopy(dict(value))
        errors = list(_training_validator().iter_errors(checked))  # fills the schema's defaults in place
        if errors:
            from jsonschema.exceptions import best_match

            from workflow_scripts.core.config_schema import schema_error

            raise schema_error(best_match(errors), key, source)
        nested = {"lora": LoraSettings(**_tuples(checked.pop("lora"))),
                  "validation": ValidationSettings(**checked.pop("validation")),
                  "quantization": (None if checked.get("quantization") is None
                                   else QuantizationSettings(**checked.pop("quantization")))}
        checked.pop("quantization", None)
        settings = cls(**checked, **nested)
        settings._check_batch_shape(batch_key or key, source)
        settings._check_length(key, source)
        settings._check_schedule(key, source)
        settings._check_kernels(key, source)
        fsdp_mesh.check(settings, key, source)
        return settings

    @classmethod
    def from_json(cls, text: str, flag: str = "--training") -> "TrainingSettings":
        """A stage's ``--training`` argument."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(flag, f"not valid JSON ({error})") from None
        if not isinstance(value, dict):
            raise ConfigError(flag, "must be a JSON object of training settings")
        return cls.parse(value, "training", flag)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (lists, not tuples): manifests, fingerprints, trackers."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    # What follows from the settings -------------------------------------------------------------------
    def quantization_record(self) -> dict[str, Any] | None:
        """The bitsandbytes settings the base is loaded with (compute dtype resolved), or None when off: written
        beside a QLoRA adapter (model/quantization.py), and given to the untrained model's evaluation of the
        variant by the evaluate_base rule, so both load the same base."""
        if self.quantization is None:
            return None
        return {"bits": self.quantization.bits, "type": self.quantization.type,
                "double_quant": self.quantization.double_quant,
                "compute_dtype": self.quantization.compute_dtype or self.precision}

    @property
    def world_size(self) -> int:
        """Processes in one training job: nodes x (GPUs per node, or CPU processes without GPUs)."""
        return self.nodes * (self.gpus if self.gpus > 0 else self.cpu_processes)

    @property
    def accumulation(self) -> int | None:
        """Micro-batches per process per optimizer step (parse checked that the division is exact); None
        under ``micro_batch_tokens``, where the batch plan gives each step its own count."""
        if self.micro_batch_tokens is not None:
            return None
        return self.effective_batch // (self.micro_batch * self.world_size)

    @property
    def full(self) -> bool:
        """``finetune: full``: every parameter trains, no LoRA."""
        return self.finetune == "full"

    @property
    def sharded(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def validating(self) -> bool:
        return bool(self.validation.every_steps)

    def with_length(self, train_rows: int) -> "TrainingSettings":
        """``max_steps`` resolved from ``epochs`` (whole global batches per epoch, as
        batching.GlobalBatchPlan draws them), so the schedule, the sampler and the log share one length."""
        if self.epochs is None:
            return self
        per_epoch = train_rows // self.effective_batch
        if per_epoch == 0:
            raise WorkflowError(f"the training split has {train_rows} rows, fewer than training.effective_batch "
                                f"({self.effective_batch}); lower the effective batch or add data")
        resolved = dataclasses.replace(self, max_steps=max(1, math.ceil(self.epochs * per_epoch)))
        resolved._check_warmup("training", None, f"the {resolved.max_steps} optimizer steps that epochs "
                               f"({self.epochs}) makes of {train_rows} training rows")
        return resolved

    def replace(self, **changes: Any) -> "TrainingSettings":
        return dataclasses.replace(self, **changes)

    # The checks no schema can state -------------------------------------------------------------------
    def _check_batch_shape(self, key: str, source: str | None) -> None:
        if self.micro_batch_tokens is not None:
            self._check_token_budget(key, source)
            return
        per_step = self.micro_batch * self.world_size
        if self.effective_batch % per_step:
            raise ConfigError(
                f"{key}.effective_batch",
                f"{self.effective_batch} is not a multiple of micro_batch ({self.micro_batch}) x processes "
                f"({self.world_size}); choose an effective batch divisible by {per_step} or change micro_batch",
                source)

    def _check_token_budget(self, key: str, source: str | None) -> None:
        """Under ``micro_batch_tokens`` the processes split the examples (not micro-batches of micro_batch), and
        every example must fit a micro-batch alone: pretokenise cuts examples to max_length, so the budget
        holds at least that."""
        if self.micro_batch_tokens < self.max_length:
            raise ConfigError(f"{key}.micro_batch_tokens", f"{self.micro_batch_tokens} is below max_length "
                              f"({self.max_length}), so an example of max_length tokens fits no micro-batch; "
                              f"set micro_batch_tokens to at least {self.max_length} (e.g. micro_batch x "
                              "max_length keeps today's memory bound) or lower max_length", source)
        if self.effective_batch % self.world_size:
            raise ConfigError(f"{key}.effective_batch", f"{self.effective_batch} is not a multiple of the "
                              f"{self.world_size} processes; choose an effective batch divisible by "
                              f"{self.world_size}", source)

    def _check_length(self, key: str, source: str | None) -> None:
        if self.max_steps is None and self.epochs is None:
            raise ConfigError(f"{key}.max_steps", "how long to train is not set: give training.max_steps (optimizer "
                              "steps) or training.epochs (passes over the training split)", source)
        if self.max_steps is not None and self.epochs is not None:
            raise ConfigError(f"{key}.epochs", f"both max_steps ({self.max_steps}) and epochs ({self.epochs}) "
                              "are set; keep one", source)

    def _check_schedule(self, key: str, source: str | None) -> None:
        """Settings that would be silently ignored or never take effect."""
        self._check_warmup(key, source)
        validation = self.validation
        if not validation.every_steps:
            for name, value, effect in (
                    ("early_stopping_patience", validation.early_stopping_patience, "training would never stop early"),
                    ("keep", None if validation.keep == "final" else validation.keep,
                     "there would be no best step to keep")):
                if value is not None:
                    raise ConfigError(f"{key}.validation.{name}", f"is {value!r} but validation.every_steps is not "
                                      f"set, so no validation loss is computed and {effect}; set "
                                      f"{key}.validation.every_steps or drop validation.{name}", source)
        if self.packing and self.micro_batch == 1 and self.micro_batch_tokens is None:
            raise ConfigError(f"{key}.packing", "is true but micro_batch is 1: packing joins the examples of one "
                              "micro-batch, so it would pack nothing; raise micro_batch (accumulation shrinks, the "
                              "effective batch stays) or set packing: false", source)

    def _check_kernels(self, key: str, source: str | None) -> None:
        """Speed switches that cannot work with these settings (training/kernels.py checks the model)."""
        needs = (("flex_attention", not self.packing, "packing: true (it is how packed rows keep a fused "
                  "attention kernel)"),
                 ("flex_attention", self.gpus == 0, "gpus > 0: PyTorch's FlexAttention has no backward on CPU"),
                 ("activation_offloading", not self.gradient_checkpointing, "gradient_checkpointing: true (only "
                  "the layer inputs that checkpointing keeps are moved to host memory)"),
                 ("fused_cross_entropy", self.gpus == 0, "gpus > 0: Liger's kernels are Triton, CUDA only"),
                 ("liger_kernels", self.gpus == 0, "gpus > 0: Liger's kernels are Triton, CUDA only"))
        for name, missing, what in needs:
            if getattr(self, name) and missing:
                raise ConfigError(f"{key}.{name}", f"is true but needs {what}; set {name}: false or change the "
                                  "setting named", source)

    def _check_warmup(self, key: str, source: str | None, steps: str | None = None) -> None:
        """Known when the workflow is read under max_steps; under epochs, once the train split's rows are."""
        if self.max_steps is not None and self.warmup_steps >= self.max_steps and self.warmup_steps > 0:
            steps = steps or f"max_steps ({self.max_steps})"
            raise ConfigError(f"{key}.warmup_steps", f"{self.warmup_steps} is not below {steps}, so the learning "
                              "rate would never leave warm-up; lower warmup_steps (e.g. to a tenth of the steps) "
                              "or train longer", source)


# Task types whose full fine-tuning is sound; vision_language's gate and loss assume a frozen, LoRA-wrapped tower.
FULL_TASKS = ("generation", "conversation", "classification", "masked_lm")


def finetune_problem(training: TrainingSettings, initialise: str, task_name: str | None = None) -> tuple[str, str] | None:
    """(key, one-line problem) when ``training.finetune`` cannot run with these settings, else None.

    Shared by the config check (experiment_config) and ``training_setup.build``, so both refuse alike."""
    if not training.full:
        if initialise == "random":
            return ("model.initialise", "random (pretraining from scratch) trains every weight, which needs "
                    "training.finetune: full; set it, or use initialise: pretrained for LoRA")
        return None
    if training.quantization is not None:
        return ("training.quantization", "full fine-tuning trains every weight, and quantised (bitsandbytes) "
                "weights cannot train; set training.quantization: null, or training.finetune: lora (QLoRA)")
    if training.sharded:
        return ("training.strategy", "fsdp shards LoRA training only; with training.finetune: full use "
                "strategy: ddp (every process holds the whole model)")
    if task_name is not None and task_name not in FULL_TASKS:
        return ("training.finetune", f"full fine-tuning is not supported for task '{task_name}' (its gate and loss "
                "assume a frozen vision tower under LoRA); set training.finetune: lora")
    return None


def sharding_problem(training: TrainingSettings, task_name: str | None = None) -> tuple[str, str, str] | None:
    """(key, reason, fix) when ``training.strategy: fsdp`` cannot run these settings, else None.

    Shared by the config check (checks/config.py, when the workflow is read) and ``training/fsdp.check_settings``
    (before anything is sharded), so both refuse alike and no accepted combination fails in a job."""
    if not training.sharded:
        return None
    if training.precision == "fp16":
        # torch.amp.GradScaler checks each rank's shard for overflow on its own: ranks could disagree on
        # skipping a step. bf16 needs no scaler.
        return ("training.precision", "does not support precision fp16 (the gradient scaler would decide on each "
                "shard alone)", "set training.precision: bf16 or fp32")
    if training.quantization is not None:
        return ("training.quantization", "cannot shard quantised base weights (bitsandbytes 4/8-bit tensors are not "
                "DTensors)", "set training.quantization: null")
    # The held-out loss runs the same number of (collective) forwards on every rank and the best adapter is
    # gathered by all of them; the metric's generation does not: each rank generates its own rows and stops
    # when they end (or rank 0 alone scores, for conversation and masked_lm).
    if training.validation.metric_examples is not None:
        return ("training.validation.metric_examples", "does not support training.validation.metric_examples yet "
                "(each rank generates the metric's rows for as many steps as its own answers need, and every sharded "
                "forward needs all ranks)", "remove training.validation.metric_examples")
    if training.fused_cross_entropy:
        # The fused loss calls the decoder directly: the FSDP root's forward, which gathers the embeddings and
        # the head, never runs ("aten.embedding.default got mixed torch.Tensor and DTensor" at every micro-step).
        return ("training.fused_cross_entropy", "does not support training.fused_cross_entropy (the fused loss calls "
                "the decoder alone, outside the sharded root's forward that gathers the embeddings and head)",
                "set training.fused_cross_entropy: false")
    if task_name == "vision_language":
        return ("training.strategy", "does not support the vision_language task (its loss reads the image path's "
                "parameters outside the model's forward, where they are still sharded)", "train it with DDP")
    return None


def _tuples(mapping: dict[str, Any]) -> dict[str, Any]:
    return {name: tuple(value) if isinstance(value, list) else value for name, value in mapping.items()}


@functools.lru_cache(maxsize=1)
def _training_validator():
    """The schema's ``training_settings`` with its ``$defs``, read once per process."""
    import yaml

    from workflow_scripts.core.config_schema import SCHEMA_PATH, _validator_with_defaults

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    part = {**schema["$defs"]["training_settings"], "$defs": schema["$defs"]}
    return _validator_with_defaults()(part)
