"""`fedccrl-serve`: predict, evaluate and inspect with an exported fedccrl ONNX model.

stdout carries only results (JSONL / CSV / JSON / the evaluation table); progress, notices and
errors go to stderr. Exit codes: 0 all good, 2 a fatal error (one line on stderr: missing path,
empty folder, not a fedccrl model, unwritable --output, --deadline passed, ...), 3 the run finished
but some inputs could not be read (each has an error record in the output).

An --output file is written atomically (fedccrl_core.fsio): it appears complete or not at all; a symlink
keeps pointing at the file written; a FIFO, a device or `-` (stdout) is written in place. A
model's metadata is checked against its graph when it is loaded. Files that are not regular files
(a FIFO named x.jpg) are skipped with a notice and never opened. JSON output never holds NaN.
"""
from __future__ import annotations

import contextlib
import csv
import glob
import json
import os
import signal
import sys
import threading
from pathlib import Path

import click
import numpy as np

from fedccrl_core import __version__
from fedccrl_core.errors import FedCCRLError
from fedccrl_core.fsio import atomic_file

EXIT_FATAL = 2
EXIT_SOME_FAILED = 3
# What a folder walk picks up; a file named explicitly (or by a glob) is always tried.
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp",
                  ".ppm", ".pgm", ".pbm", ".pnm")
CSV_FIELDS = ("path", "label", "score", "topk", "error")


class Fatal(FedCCRLError):
    """Stops the command with one line on stderr and exit code 2."""


class DeadlinePassed(BaseException):
    """--deadline: raised by SIGALRM wherever the main thread is; a BaseException (as KeyboardInterrupt),
    so no `except Exception` on the way (one unreadable image is an error record) can swallow it."""


def _note(msg: str) -> None:
    click.echo(f"fedccrl-serve: {msg}", err=True)


# ---------------------------------------------------------------- model

class ServedModel:
    """An onnxruntime session of a fedccrl export plus its metadata (the only source of preprocessing)."""

    def __init__(self, path: Path, device: str = "auto"):
        import onnxruntime as ort

        from serving.onnx_export import INPUT_NAME, OUTPUT_NAME, NotAFedccrlModel, check_graph, parse_metadata
        from serving.preprocess import check_resize_policy

        if not path.is_file():
            raise Fatal(f"{path}: model file not found" if not path.exists() else f"{path}: not a file")
        ort.set_default_logger_severity(3)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        requested = _providers(device)
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=requested)
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
            first = (str(e).splitlines() or [e.__class__.__name__])[0][:200]
            raise NotAFedccrlModel(f"{path}: not a readable ONNX model ({first})") from e
        self.meta = parse_metadata(self.session.get_modelmeta().custom_metadata_map, str(path))
        check_resize_policy(self.meta, str(path))
        names_in = [i.name for i in self.session.get_inputs()]
        names_out = [o.name for o in self.session.get_outputs()]
        if names_in != [INPUT_NAME] or OUTPUT_NAME not in names_out:
            raise NotAFedccrlModel(f"{path}: expected input '{INPUT_NAME}' and output '{OUTPUT_NAME}', "
                                   f"found inputs {names_in} outputs {names_out}")
        self.input_name, self.output_name = INPUT_NAME, OUTPUT_NAME
        out_shape = next(o.shape for o in self.session.get_outputs() if o.name == OUTPUT_NAME)
        check_graph(self.meta, self.session.get_inputs()[0].shape, out_shape, str(path))
        self.path = path
        used = self.session.get_providers()
        if "CUDAExecutionProvider" in requested and "CUDAExecutionProvider" not in used:
            _note(f"--device {device}: onnxruntime could not start CUDAExecutionProvider; falling back to CPU")
        self.device = "cuda" if "CUDAExecutionProvider" in used else "cpu"

    def logits(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 0:
            return np.zeros((0, len(self.meta.classes)), np.float32)
        out = self.session.run([self.output_name], {self.input_name: x})[0]
        if out.ndim != 2 or out.shape[1] != len(self.meta.classes):
            raise Fatal(f"{self.path}: the model returned logits of shape {list(out.shape)} for "
                        f"{len(self.meta.classes)} class names in its metadata")
        return out


def _providers(device: str) -> list[str]:
    """CUDA first when asked (or auto) and usable; otherwise CPU, with a notice when cuda was asked for."""
    import onnxruntime as ort

    if device == "cpu":
        return ["CPUExecutionProvider"]
    reason = None
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        reason = "this onnxruntime build has no CUDAExecutionProvider"
    elif not _cuda_driver_present():
        reason = "no CUDA driver (libcuda.so.1) on this machine"
    if reason is None:
        try:  # onnxruntime-gpu finds the CUDA/cuDNN libraries of the nvidia-* wheels this way
            ort.preload_dlls()
        except Exception:  # noqa: BLE001 - older builds lack it; the session falls back by itself
            pass
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if device == "cuda":
        _note(f"--device cuda: {reason}; falling back to CPU")
    return ["CPUExecutionProvider"]


def _cuda_driver_present() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def predict_paths(model: ServedModel, paths: list[Path], batch_size: int, workers: int, quiet: bool):
    """Yield (path, probabilities or None, error or None) for every path, in order, batch by batch."""
    from serving.preprocess import preprocess_files

    done = 0
    for start in range(0, len(paths), batch_size):
        chunk = paths[start:start + batch_size]
        x, good, errors = preprocess_files(chunk, model.meta, workers)
        probs = dict(zip(good, softmax(model.logits(x)))) if good else {}
        for i, p in list(probs.items()):
            if not np.isfinite(p).all():  # NaN/inf weights or inputs: an error record, never "score": NaN
                del probs[i]
                errors[i] = "the model returned non-finite scores (NaN or inf) for this image"
        for i, path in enumerate(chunk):
            yield path, probs.get(i), errors.get(i)
        done += len(chunk)
        if not quiet:
            _note(f"{done}/{len(paths)} images")


# ---------------------------------------------------------------- inputs

def _regular(path: Path) -> bool:
    """False, with a notice naming the file and why, for a FIFO, socket or device: it is never opened."""
    from serving.preprocess import not_regular

    why = not_regular(path)
    if why:
        _note(f"skipped {path}: {why}")
    return why is None


def _walk(folder: Path) -> tuple[list[Path], int]:
    """Image files under folder (recursive, sorted, hidden entries skipped) and the count of skipped files."""
    from fedccrl_core.data.images import is_ignored_name

    found, skipped = [], 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if is_ignored_name(name):
                continue
            if name.lower().endswith(IMAGE_SUFFIXES):
                if _regular(Path(root) / name):
                    found.append(Path(root) / name)
            else:
                skipped += 1
    return found, skipped


def collect_inputs(specs: tuple[str, ...]) -> list[Path]:
    """Files, folders (recursive) and glob patterns -> an ordered, de-duplicated list of files."""
    out: list[Path] = []
    skipped = 0
    for spec in specs:
        p = Path(spec)
        if p.is_file():
            out.append(p)
        elif p.exists() and not p.is_dir():
            _regular(p)  # a FIFO, socket or device named explicitly: skipped with a notice
        elif p.is_dir():
            files, n_skip = _walk(p)
            if not files:
                raise Fatal(f"{spec}: folder has no image files ({', '.join(IMAGE_SUFFIXES[:6])}, ...)")
            out += files
            skipped += n_skip
        elif glob.has_magic(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise Fatal(f"{spec}: no file matches this pattern")
            for m in map(Path, matches):
                if m.is_dir():
                    files, n_skip = _walk(m)
                    out += files
                    skipped += n_skip
                elif _regular(m):
                    out.append(m)
        else:
            raise Fatal(f"{spec}: no such file or folder")
    if skipped:
        _note(f"skipped {skipped} files without an image extension in the folders given")
    if not out:
        raise Fatal("no input images")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------- evaluate helpers

def labelled_files(folder: Path, classes: tuple[str, ...]) -> tuple[list[Path], list[int]]:
    """<folder>/<class>/<image...> -> (files, class indices). Unknown class folders are an error."""
    if not folder.is_dir():
        raise Fatal(f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder")
    subdirs = sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not subdirs:
        raise Fatal(f"{folder}: no class folders (expected <class>/<image> with classes {', '.join(classes)})")
    unknown = [d.name for d in subdirs if d.name not in classes]
    if unknown:
        raise Fatal(f"{folder}: class folders not among the model's classes: {', '.join(unknown)} "
                    f"(model classes: {', '.join(classes)})")
    files, labels = [], []
    for d in subdirs:
        found, _ = _walk(d)
        files += found
        labels += [classes.index(d.name)] * len(found)
    if not files:
        raise Fatal(f"{folder}: the class folders hold no image files")
    return files, labels


def confusion_report(pairs: list[tuple[int, int]], classes: tuple[str, ...]) -> dict:
    """(true, predicted) index pairs -> accuracy, per-class accuracy and confusion matrix (rows: true)."""
    k = len(classes)  # numpy, not torch: serving imports no torch
    cm_arr = np.zeros((k, k), dtype=np.int64)
    for t, p in pairs:
        cm_arr[t, p] += 1
    cm = cm_arr.tolist()
    per_class = {}
    for i, name in enumerate(classes):
        n = sum(cm[i])
        per_class[name] = {"n": n, "correct": cm[i][i], "accuracy": cm[i][i] / n if n else None}
    n = len(pairs)
    return {"n_images": n, "accuracy": sum(cm[i][i] for i in range(len(classes))) / n if n else None,
            "per_class": per_class, "classes": list(classes), "confusion_matrix": cm}


def format_table(report: dict) -> str:
    """A plain-text view of confusion_report: per-class accuracy, then the confusion matrix."""
    classes = report["classes"]
    w = max(8, *(len(c) for c in classes)) + 2
    acc = report["accuracy"]
    lines = [f"accuracy {acc:.4f} on {report['n_images']} images" if acc is not None else "accuracy n/a (0 images)"]
    if report.get("n_failed"):
        lines[0] += f" ({report['n_failed']} unreadable, excluded)"
    lines += ["", f"{'class':<{w}}{'n':>7}{'correct':>9}{'accuracy':>10}"]
    for name, row in report["per_class"].items():
        a = f"{row['accuracy']:.4f}" if row["accuracy"] is not None else "-"
        lines.append(f"{name:<{w}}{row['n']:>7}{row['correct']:>9}{a:>10}")
    cw = max(6, *(len(c) for c in classes)) + 1
    lines += ["", "confusion matrix (rows: true class, columns: predicted)",
              " " * w + "".join(f"{c[:cw - 1]:>{cw}}" for c in classes)]
    for name, row in zip(classes, report["confusion_matrix"]):
        lines.append(f"{name:<{w}}" + "".join(f"{v:>{cw}}" for v in row))
    return "\n".join(lines)


# ---------------------------------------------------------------- output

def _record(path: Path, probs, error, classes, top_k: int) -> dict:
    if error is not None:
        return {"path": str(path), "error": error}
    order = np.argsort(-probs, kind="stable")[:top_k]
    return {"path": str(path), "label": classes[order[0]], "score": float(probs[order[0]]),
            "topk": [{"label": classes[j], "score": float(probs[j])} for j in order]}


class _Writer:
    def __init__(self, stream, fmt: str):
        self.stream, self.fmt = stream, fmt
        if fmt == "csv":
            self.csv = csv.DictWriter(stream, fieldnames=CSV_FIELDS, lineterminator="\n")
            self.csv.writeheader()

    def write(self, rec: dict) -> None:
        if self.fmt == "jsonl":
            self.stream.write(json.dumps(rec, allow_nan=False) + "\n")
        else:
            row = dict(rec)
            if "topk" in row:
                row["topk"] = json.dumps(row["topk"])
            self.csv.writerow(row)
        self.stream.flush()


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
_device_opt = click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                           help="cuda uses onnxruntime's CUDAExecutionProvider when usable, else falls back to CPU.")
_batch_opt = click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
_workers_opt = click.option("--workers", type=click.IntRange(min=1), default=min(4, os.cpu_count() or 1),
                            show_default=True, help="threads decoding images")
_quiet_opt = click.option("--quiet", "-q", is_flag=True, help="no progress lines on stderr")
_deadline_opt = click.option("--deadline", type=click.FloatRange(min=0, min_open=True), default=None,
                             metavar="SECONDS", help="stop with exit code 2 when the whole run (model loading "
                             "included) takes longer; --output is then not written")


@contextlib.contextmanager
def _deadline(seconds: float | None, output: Path | None):
    """Raise Fatal in the main thread when `seconds` of wall-clock time have passed (SIGALRM)."""
    if not seconds:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        raise Fatal("--deadline works only in the main thread")

    def expire(signum, frame):
        raise DeadlinePassed(f"--deadline {seconds:g} s passed before the run finished"
                    + (f"; {output} not written" if output else ""))

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@click.group()
@click.version_option(__version__, prog_name="fedccrl-serve")
def main():
    """Run an exported fedccrl ONNX model on image files. The preprocessing (input size, resize
    policy, mean/std) and the class names come from the model file's metadata."""


@main.command()
@_model_arg
@click.argument("inputs", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True)
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="write results here, not stdout (a FIFO or device is written in place; - is stdout)")
@click.option("--top-k", type=click.IntRange(min=1), default=5, show_default=True,
              help="classes listed per image (capped at the number of classes)")
@_batch_opt
@_device_opt
@_workers_opt
@_quiet_opt
@_deadline_opt
@_fatal_guard
def predict(model, inputs, fmt, output, top_k, batch_size, device, workers, quiet, deadline):
    """Predict the class of INPUTS (files, folders searched recursively, or glob patterns).

    One record per input: path, label, score (softmax probability), topk. An unreadable input gets
    a record with path and error instead; the others are still predicted and the exit code is 3.
    """
    with _deadline(deadline, output), contextlib.ExitStack() as stack:
        served = ServedModel(model, device)
        paths = collect_inputs(inputs)
        classes = served.meta.classes
        k = min(top_k, len(classes))
        # opened before any image is read: an unwritable --output fails first; complete or absent at the end
        stream = stack.enter_context(atomic_file(output, "w", newline="")) if output else sys.stdout
        if not quiet:
            _note(f"{len(paths)} inputs, model {model.name} on {served.device}")
        n_failed = 0
        try:
            writer = _Writer(stream, fmt)
            for path, probs, error in predict_paths(served, paths, batch_size, workers, quiet):
                n_failed += error is not None
                writer.write(_record(path, probs, error, classes, k))
        except BrokenPipeError:  # `fedccrl-serve predict ... | head`: the reader left; stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
    if n_failed:
        _note(f"{n_failed} of {len(paths)} inputs could not be read (see their error records)")
        sys.exit(EXIT_SOME_FAILED)


@main.command()
@_model_arg
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path),
              help="write the JSON report here (- is stdout, the table then goes to stderr)")
@click.option("--json", "as_json", is_flag=True, help="print the JSON report on stdout (the table goes to stderr)")
@_batch_opt
@_device_opt
@_workers_opt
@_quiet_opt
@_deadline_opt
@_fatal_guard
def evaluate(model, folder, output, as_json, batch_size, device, workers, quiet, deadline):
    """Accuracy of the model on a labelled FOLDER laid out as <class>/<image> (e.g. an unseen domain).

    Reports accuracy, per-class accuracy and the confusion matrix (rows: true class, columns:
    predicted). Class folder names must be the model's class names.
    """
    with _deadline(deadline, output), contextlib.ExitStack() as stack:
        served = ServedModel(model, device)
        classes = served.meta.classes
        files, labels = labelled_files(folder, classes)
        # opened before any image is read: an unwritable --output fails first; complete or absent at the end
        out_file = stack.enter_context(atomic_file(output, "w")) if output else None
        if not quiet:
            _note(f"{len(files)} images in {len(set(labels))} class folders, model {model.name} on {served.device}")
        preds, errors = [], []
        for (path, probs, error), y in zip(predict_paths(served, files, batch_size, workers, quiet), labels):
            if error is not None:
                errors.append({"path": str(path), "error": error})
            else:
                preds.append((y, int(np.argmax(probs))))
        report = confusion_report(preds, classes)
        report.update(model=str(model), folder=str(folder), n_failed=len(errors), errors=errors)
        text = json.dumps(report, indent=2, allow_nan=False)
        if out_file is not None:
            out_file.write(text + "\n")
    if as_json:
        click.echo(text)
    click.echo(format_table(report), err=as_json or str(output) == "-")  # stdout carries JSON only
    if errors:
        _note(f"{len(errors)} of {len(files)} images could not be read (listed under 'errors')")
        sys.exit(EXIT_SOME_FAILED)


@main.command()
@_model_arg
@_fatal_guard
def info(model):
    """Print the model's fedccrl metadata (classes, preprocessing, provenance) and its I/O as JSON."""
    served = ServedModel(model, "cpu")
    io = lambda args: [{"name": a.name, "shape": list(a.shape), "type": a.type} for a in args]  # noqa: E731
    click.echo(json.dumps({"metadata": served.meta.as_dict(), "inputs": io(served.session.get_inputs()),
                           "outputs": io(served.session.get_outputs())}, indent=2))


if __name__ == "__main__":
    main()
