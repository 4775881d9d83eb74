"""`fedccrl-serve evaluate`'s report: accuracy, per-class accuracy and the confusion matrix, typed where it is made
(`ConfusionReport`), written as JSON (`to_dict`) and shown as a plain-text table (`format_table`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fedccrl_core.learning.confusion import confusion_matrix


@dataclass(frozen=True)
class ClassAccuracy:
    """One class of the report: its images, how many were predicted as it, their share (None without an image)."""

    n: int
    correct: int
    accuracy: float | None


@dataclass(frozen=True)
class UnreadImage:
    """An image of the folder that could not be read, excluded from the counts, and why."""

    path: str
    error: str


@dataclass(frozen=True)
class ConfusionReport:
    """Accuracy over the `n_images` read (None without one), per class, the confusion matrix (rows: true class,
    columns: predicted), the model and folder evaluated, and the images that could not be read."""

    n_images: int
    accuracy: float | None
    per_class: dict[str, ClassAccuracy]
    classes: list[str]
    confusion_matrix: list[list[int]]
    model: str
    folder: str
    n_failed: int
    errors: list[UnreadImage]

    def to_dict(self) -> dict:
        """The JSON report: every field under its name, in declaration order (an accuracy without an image: null)."""
        return dataclasses.asdict(self)


def confusion_report(
    y_true: list[int], y_pred: list[int], classes: tuple[str, ...], model: str, folder: str, errors: list[UnreadImage]
) -> ConfusionReport:
    """True and predicted class indices of the images read -> accuracy, per-class accuracy and confusion matrix of
    `model` on `folder`; `errors`: the images that could not be read."""
    cm = confusion_matrix(y_true, y_pred, len(classes)).tolist()
    per_class = {}
    for i, name in enumerate(classes):
        n = sum(cm[i])
        per_class[name] = ClassAccuracy(n, cm[i][i], cm[i][i] / n if n else None)
    n = len(y_true)
    return ConfusionReport(
        n_images=n,
        accuracy=sum(cm[i][i] for i in range(len(classes))) / n if n else None,
        per_class=per_class,
        classes=list(classes),
        confusion_matrix=cm,
        model=model,
        folder=folder,
        n_failed=len(errors),
        errors=errors,
    )


def format_table(report: ConfusionReport) -> str:
    """A plain-text view of the report: per-class accuracy, then the confusion matrix."""
    classes = report.classes
    w = max(8, *(len(c) for c in classes)) + 2
    acc = report.accuracy
    lines = [f"accuracy {acc:.4f} on {report.n_images} images" if acc is not None else "accuracy n/a (0 images)"]
    if report.n_failed:
        lines[0] += f" ({report.n_failed} unreadable, excluded)"
    lines += ["", f"{'class':<{w}}{'n':>7}{'correct':>9}{'accuracy':>10}"]
    for name, score in report.per_class.items():
        a = f"{score.accuracy:.4f}" if score.accuracy is not None else "-"
        lines.append(f"{name:<{w}}{score.n:>7}{score.correct:>9}{a:>10}")
    cw = max(6, *(len(c) for c in classes)) + 1
    lines += [
        "",
        "confusion matrix (rows: true class, columns: predicted)",
        " " * w + "".join(f"{c[: cw - 1]:>{cw}}" for c in classes),
    ]
    for name, row in zip(classes, report.confusion_matrix):
        lines.append(f"{name:<{w}}" + "".join(f"{v:>{cw}}" for v in row))
    return "\n".join(lines)
