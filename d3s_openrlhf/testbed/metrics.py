"""Per-step training metrics as OpenRLHF logged them (``--logger.tensorboard_dir``), for the demo and the tests."""

import glob
import os


def read_train_scalars(tensorboard_dir):
    """``{global_step: {key: value}}`` from every event file under ``tensorboard_dir``.

    OpenRLHF's ``TensorboardLogger`` writes the status of step ``s`` (1-based) as scalars ``train/<key>`` under
    ``<tensorboard_dir>/<run name>/``; a resumed run adds files (possibly in another run directory). Later
    files win for a step logged twice.
    """
    return read_scalars(tensorboard_dir, "train/")


def read_scalars(tensorboard_dir, prefix):
    """:func:`read_train_scalars` for the tags under ``prefix`` (``"eval/"``: the evaluations, by global step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(
        glob.glob(os.path.join(tensorboard_dir, "**", "events.out.tfevents.*"), recursive=True), key=os.path.getmtime
    )
    steps = {}
    for path in files:
        accumulator = EventAccumulator(path, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            if not tag.startswith(prefix):
                continue
            key = tag[len(prefix) :]
            for event in accumulator.Scalars(tag):
                steps.setdefault(event.step, {})[key] = event.value
    return dict(sorted(steps.items()))
