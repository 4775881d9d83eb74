"""`fedccrl-serve`: predict, evaluate and inspect with an exported fedccrl ONNX model (the click commands; the
runtime is serving/fedccrl_serving/runtime.py, the inputs serving/fedccrl_serving/inputs.py, the evaluation report serving/fedccrl_serving/report.py,
predict's records serving/fedccrl_serving/predictions.py, --deadline serving/fedccrl_serving/deadline.py).

stdout carries only results (JSONL / CSV / JSON / the evaluation table); progress, notices and
errors go to stderr. Exit codes: 0 all good, 2 a fatal error (one line on stderr: missing path,
empty folder, not a fedccrl model, unwritable --output, --deadline passed, ...), 3 the run finished
but some inputs could not be read (each has an error record in the output).

An --output file is written atomically (fedccrl_core.foundation.fsio): it appears complete or not at all; a symlink
keeps pointing at the file written; a FIFO, a device or `-` (stdout) is written in place. A
model's metadata is checked against its graph when it is loaded. Files that are not regular files
(a FIFO named x.jpg) are skipped with a notice and never opened. JSON output never holds NaN.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click
import numpy as np

from fedccrl_core import __version__
from fedccrl_core.foundation.errors import FedCCRLError
from fedccrl_core.foundation.fsio import atomic_file
from fedccrl_serving.console import note
from fedccrl_serving.deadline import DeadlinePassed, run_deadline
from fedccrl_serving.inputs import collect_inputs, labelled_files
from fedccrl_serving.metadata import card_path
from fedccrl_serving.predictions import PredictionWriter, prediction_record
from fedccrl_serving.report import UnreadImage, confusion_report, format_table
from fedccrl_serving.runtime import ServedModel, model_file, predict_paths

EXIT_FATAL = 2
EXIT_SOME_FAILED = 3


def _fatal_guard(fn):
    """Run a command body; a known error becomes one line on stderr and exit code 2."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (FedCCRLError, DeadlinePassed) as e:
            click.echo(f"fedccrl-serve: error: {e}", err=True)
            sys.exit(EXIT_FATAL)

    return wrapper


_model_arg = click.argument("model", type=click.Path(path_type=Path))
_device_opt = click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="cuda uses onnxruntime's CUDAExecutionProvider when usable, else falls back to CPU.",
)
_batch_opt = click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
_workers_opt = click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=min(4, os.cpu_count() or 1),
    show_default=True,
    help="threads decoding images",
)
_int8_opt = click.option(
    "--int8",
    is_flag=True,
    help="use the INT8 copy beside MODEL (model.int8.onnx, written by `fedccrl export` with export.int8)",
)
_quiet_opt = click.option("--quiet", "-q", is_flag=True, help="no progress lines on stderr")
_deadline_opt = click.option(
    "--deadline",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="stop with exit code 2 when the whole run (model loading included) takes longer; --output is then not written",
)


@click.group()
@click.version_option(__version__, prog_name="fedccrl-serve")
def main():
    """Run an exported fedccrl ONNX model on image files. The preprocessing (input size, resize
    policy, mean/std) and the class names come from the model file's metadata."""


@main.command()
@_model_arg
@click.argument("inputs", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write results here, not stdout (a FIFO or device is written in place; - is stdout)",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="classes listed per image (capped at the number of classes)",
)
@_batch_opt
@_device_opt
@_workers_opt
@_quiet_opt
@_deadline_opt
@_int8_opt
@_fatal_guard
def predict(model, inputs, fmt, output, top_k, batch_size, device, workers, quiet, deadline, int8):
    """Predict the class of INPUTS (files, folders searched recursively, or glob patterns).

    One record per input: path, label, score (softmax probability), topk. An unreadable input gets
    a record with path and error instead; the others are still predicted and the exit code is 3.
    """
    with run_deadline(deadline, output), contextlib.ExitStack() as stack:
        model = model_file(model, int8)
        served = ServedModel(model, device, int8)
        paths = collect_inputs(inputs)
        classes = served.meta.classes
        k = min(top_k, len(classes))
        # opened before any image is read: an unwritable --output fails first; complete or absent at the end
        stream = stack.enter_context(atomic_file(output, "w", newline="")) if output else sys.stdout
        if not quiet:
            note(f"{len(paths)} inputs, model {model.name} on {served.device}")
        n_failed = 0
        try:
            writer = PredictionWriter(stream, fmt)
            for path, probs, error in predict_paths(served, paths, batch_size, workers, quiet):
                n_failed += error is not None
                writer.write(prediction_record(path, probs, error, classes, k))
        except BrokenPipeError:  # `fedccrl-serve predict ... | head`: the reader left; stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
    if n_failed:
        note(f"{n_failed} of {len(paths)} inputs could not be read (see their error records)")
        sys.exit(EXIT_SOME_FAILED)


@main.command()
@_model_arg
@click.argument("folder", type=click.Path(path_type=Path))
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write the JSON report here (- is stdout, the table then goes to stderr)",
)
@click.option("--json", "as_json", is_flag=True, help="print the JSON report on stdout (the table goes to stderr)")
@_batch_opt
@_device_opt
@_workers_opt
@_quiet_opt
@_deadline_opt
@_int8_opt
@_fatal_guard
def evaluate(model, folder, output, as_json, batch_size, device, workers, quiet, deadline, int8):
    """Accuracy of the model on a labelled FOLDER laid out as <class>/<image> (e.g. an unseen domain).

    Reports accuracy, per-class accuracy and the confusion matrix (rows: true class, columns:
    predicted). Class folder names must be the model's class names.
    """
    with run_deadline(deadline, output), contextlib.ExitStack() as stack:
        model = model_file(model, int8)
        served = ServedModel(model, device, int8)
        classes = served.meta.classes
        files, labels = labelled_files(folder, classes)
        # opened before any image is read: an unwritable --output fails first; complete or absent at the end
        out_file = stack.enter_context(atomic_file(output, "w")) if output else None
        if not quiet:
            note(f"{len(files)} images in {len(set(labels))} class folders, model {model.name} on {served.device}")
        truth, preds, errors = [], [], []
        for (path, probs, error), y in zip(predict_paths(served, files, batch_size, workers, quiet), labels):
            if error is not None:
                errors.append(UnreadImage(str(path), error))
            else:
                truth.append(y)
                preds.append(int(np.argmax(probs)))
        report = confusion_report(truth, preds, classes, str(model), str(folder), errors)
        text = json.dumps(report.to_dict(), indent=2, allow_nan=False)
        if out_file is not None:
            out_file.write(text + "\n")
    if as_json:
        click.echo(text)
    click.echo(format_table(report), err=as_json or str(output) == "-")  # stdout carries JSON only
    if errors:
        note(f"{len(errors)} of {len(files)} images could not be read (listed under 'errors')")
        sys.exit(EXIT_SOME_FAILED)


@main.command()
@_model_arg
@_int8_opt
@_fatal_guard
def info(model, int8):
    """Print the model's fedccrl metadata (classes, preprocessing, provenance; an INT8 copy's precision and
    calibration), its I/O and where its model card is (null, and a notice, when none is beside it) as JSON."""
    model = model_file(model, int8)
    served = ServedModel(model, "cpu", int8)
    card = card_path(model)
    if not card.is_file():
        note(f"no model card beside {model} (no {card.name}: `fedccrl export` writes one)")
    io = lambda args: [{"name": a.name, "shape": list(a.shape), "type": a.type} for a in args]  # noqa: E731
    click.echo(
        json.dumps(
            {
                "file": str(model),
                "bytes": model.stat().st_size,
                "precision": served.meta.precision,
                "model_card": str(card) if card.is_file() else None,
                "metadata": served.meta.as_dict(),
                "inputs": io(served.session.get_inputs()),
                "outputs": io(served.session.get_outputs()),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
