"""tests/test_fsdp_loading.py's torchrun entry for a classification model under FSDP's rank-0 loading.

Argument order: model dir, --training JSON (strategy fsdp), output dir. Every rank builds the training
model of the classification task (``training_setup.build``: a sequence-classification head that the
checkpoint lacks, drawn on rank 0 from the seeded generator, and PEFT's trainable ``modules_to_save``
copy of it); rank 0 also builds it unsharded in a world of one from the same seed, the reference. Each
rank writes ``<out>/rank<N>.json``: for every head parameter, whether the gathered full tensor and this
rank's own shard equal the reference's.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from workflow_scripts.core.settings import TrainingSettings  # noqa: E402
from workflow_scripts.training import distributed, training_setup  # noqa: E402

LABELS = ["negative", "neutral", "positive"]
META = {"task": "classification", "task_meta": {"labels": LABELS}, "pad_token_id": 0}


def head(model: torch.nn.Module) -> dict:
    return {name: p for name, p in model.named_parameters() if ".score." in name or name.startswith("score.")}


def main(model_dir: str, training_text: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    training = TrainingSettings.from_json(training_text)
    context = distributed.setup(use_cuda=False)
    torch.manual_seed(0)
    sharded = head(training_setup.build(model_dir, training, context, data_meta=META).peft_model)
    reference = {}
    if context.rank == 0:
        alone = distributed.DistributedContext(0, 0, 1, 1, torch.device("cpu"), None)
        torch.manual_seed(0)
        unsharded = training.replace(strategy="ddp", cpu_processes=1)
        reference = {n: p.detach().clone() for n, p in
                     head(training_setup.build(model_dir, unsharded, alone, data_meta=META).peft_model).items()}
    shared = [reference]
    dist.broadcast_object_list(shared, src=0)
    reference = shared[0]
    from torch.distributed.tensor import distribute_tensor

    report = {"rank": context.rank, "names": sorted(sharded), "reference_names": sorted(reference), "equal": {}}
    for name, parameter in sorted(sharded.items()):
        full = parameter.full_tensor()  # collective: every rank's shard
        mine = distribute_tensor(reference[name], parameter.device_mesh, parameter.placements,
                                 src_data_rank=None).to_local()  # this rank's slice, no communication
        report["equal"][name] = {"full": bool(torch.equal(full, reference[name])),
                                 "shard": bool(torch.equal(parameter.to_local(), mine)),
                                 "shard_rows": parameter.to_local().shape[0] if parameter.dim() else 0}
    Path(out_dir, f"rank{context.rank}.json").write_text(json.dumps(report, indent=2))
    distributed.teardown(context)


if __name__ == "__main__":
    main(*sys.argv[1:4])
