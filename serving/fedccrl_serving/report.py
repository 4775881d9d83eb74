"""`fedccrl-serve evaluate`'s report: accuracy, per-class accuracy and the confusion matrix, as JSON and as a
plain-text table."""

from __future__ import annotations

from fedccrl_core.learning.confusion import confusion_matrix


def confusion_report(y_true: list[int], y_pred: list[int], classes: tuple[str, ...]) -> dict:
    """True and predicted class indices -> accuracy, per-class accuracy and confusion matrix (rows: true)."""
    cm = confusion_matrix(y_true, y_pred, len(classes)).tolist()
    per_class = {}
    for i, name in enumerate(classes):
        n = sum(cm[i])
        per_class[name] = {"n": n, "correct": cm[i][i], "accuracy": cm[i][i] / n if n else None}
    n = len(y_true)
    return {
        "n_images": n,
        "accuracy": sum(cm[i][i] for i in range(len(classes))) / n if n else None,
        "per_class": per_class,
        "classes": list(classes),
        "confusion_matrix": cm,
    }


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
    lines += [
        "",
        "confusion matrix (rows: true class, columns: predicted)",
        " " * w + "".join(f"{c[: cw - 1]:>{cw}}" for c in classes),
    ]
    for name, row in zip(classes, report["confusion_matrix"]):
        lines.append(f"{name:<{w}}" + "".join(f"{v:>{cw}}" for v in row))
    return "\n".join(lines)
