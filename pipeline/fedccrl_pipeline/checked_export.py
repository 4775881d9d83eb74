"""`fedccrl export`'s engine: a trained model -> its ONNX file (onnx_export.py), checked for parity with PyTorch on
the held-out domain (onnx_parity.py), with its parity figures and model card; the outputs appear together or not at
all.

It imports torch (the exporter and the parity reference), so it lives here and not in the torch-free `serving`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import numpy as np

from fedccrl_pipeline.onnx_export import export_onnx
from fedccrl_pipeline.onnx_parity import ParityError, ParityFigures, cpu_session, parity
from fedccrl_pipeline.quantize import Int8Figures

# an export's folder: the model and its parity figures (export_checked)
ONNX_FILE, PARITY_FILE = "model.onnx", "parity.json"
# without a test folder of the held-out domain, parity is measured on this many generated images (seeded)
GENERATED_IMAGES, GENERATED_SEED = 64, 0
HELD_OUT_IMAGES, GENERATED = "held-out images", "generated images"  # ExportParity.inputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportParity(ParityFigures):
    """An export's parity figures (parity.json, written by `to_dict`): what `parity` measured, the agreement it had
    to reach, the held-out domain, the ONNX file's size, what the check ran on (`inputs`: HELD_OUT_IMAGES, or
    GENERATED without accuracies) and the INT8 copy's gate when the copy was written."""

    min_agreement: float
    held_out_domain: str
    onnx_bytes: int
    inputs: str
    int8: Int8Figures | None = None

    def to_dict(self) -> dict:
        """parity.json: every field under its name, in declaration order (the measured figures first), the INT8
        gate as an object; an accuracy not measured (generated images) and `int8` without a copy are left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def example_images(images_u8: np.ndarray) -> np.ndarray:
    """The input example logged with the MLflow model: the first two images of the held-out domain."""
    return np.ascontiguousarray(images_u8[:2])


def generated_images(image_size: int, n: int = GENERATED_IMAGES) -> np.ndarray:
    """uint8 NHWC images of uniform noise (seeded): the parity check's inputs when no held-out image is at hand.
    ONNX and PyTorch see the same inputs, so their agreement is measured; no accuracy is."""
    rng = np.random.default_rng(GENERATED_SEED)
    return rng.integers(0, 256, size=(n, image_size, image_size, 3), dtype=np.uint8)


def _parity_inputs(shards: Path | None, meta, private: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The held-out domain's images and labels from `shards` (its val rows only for a model trained under
    train.privacy, `private`: data/shards.py held_out_parts), or generated images (no labels) without it."""
    import sys

    from fedccrl_core.data.shards import load_domain_test

    if shards is None:
        print(
            f"export: no test folder of {meta.held_out_domain}: parity on {GENERATED_IMAGES} generated images "
            "(agreement only, no accuracy)",
            file=sys.stderr,
        )
        return generated_images(meta.image_size), None
    x, y = load_domain_test(shards, meta.held_out_domain, private)
    if x.shape[1:] != (meta.image_size, meta.image_size, 3):
        raise ValueError(
            f"{shards}: held-out images are {x.shape[1:]}, the model expects "
            f"{meta.image_size}x{meta.image_size}x3 (shards from another image size?)"
        )
    return x, y


def _remove(paths) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def _all_or_none(outputs):
    """Outputs that appear together or not at all: each one already in place is removed when the body fails."""
    try:
        yield
    except BaseException:
        _remove(outputs)
        raise


def _parity_checked(onnx_path: Path, model, meta, xy, min_agreement: float, batch_size: int) -> ExportParity:
    """The parity figures of the ONNX file at `onnx_path` against `model` on the images `xy` (labels None: generated
    images); ParityError when their top-1 agreement is below `min_agreement`."""
    import sys

    x, y = xy
    measured = parity(cpu_session(onnx_path), model, x, meta.mean, meta.std, labels=y, batch_size=batch_size)
    what = "generated" if y is None else meta.held_out_domain
    n, agreement, diff = measured.n_images, measured.top1_agreement, measured.max_abs_logit_diff
    print(f"parity on {n} {what} images: top-1 agreement {agreement:.6f}, max |logit diff| {diff:.3g}", file=sys.stderr)
    if agreement < min_agreement:
        raise ParityError(
            f"ONNX/PyTorch top-1 agreement {agreement:.6f} < --min-agreement {min_agreement} "
            f"on {n} images (max |logit diff| {diff:.3g}); no model.onnx written"
        )
    return ExportParity(
        **dataclasses.asdict(measured),
        min_agreement=min_agreement,
        held_out_domain=meta.held_out_domain,
        onnx_bytes=onnx_path.stat().st_size,
        inputs=GENERATED if y is None else HELD_OUT_IMAGES,
    )


def _checked_inputs(model_path: Path, shards: Path | None, card_maker, int8, study_images: bool):
    """(the card's maker, the model, its metadata, the parity inputs, whether the run trained under train.privacy),
    each checked before any work: the card's records, the model file, its held-out domain, INT8's need of shards,
    the images' size against the model's."""
    from fedccrl_core.algorithms import load_model
    from fedccrl_core.foundation import contract

    if model_path.is_dir():
        model_path = model_path / contract.MODEL_FILE
    card, private_run = card_maker(model_path)
    model, meta = load_model(model_path)
    meta.require(model_path, "held_out_domain")
    if int8 is not None and shards is None:
        raise ValueError("--int8: needs --shards (the INT8 copy is calibrated and gated on shard images)")
    private = study_images and private_run  # an operator's test folder is no site's images
    return card, model, meta, _parity_inputs(shards, meta, private), private


def export_checked(
    model_path: Path,
    shards: Path | None,
    out: Path,
    min_agreement: float,
    batch_size: int,
    publish=None,
    traces: dict | None = None,
    int8=None,
    *,
    card_maker,
    study_images: bool = True,
) -> ExportParity:
    """A trained model -> out/model.onnx + out/parity.json + out/MODEL_CARD.md (`fedccrl export`). Parity is
    measured on every image of the held-out domain in `shards` (ONNX Runtime CPU vs PyTorch; a run under train.privacy
    on the study's shards, `study_images`: its val rows, data/shards.py held_out_parts), or without `shards`
    on generated images (agreement only; parity.json's `inputs` says which); below `min_agreement` a
    ParityError, and no output. Outputs appear only on success: the card and parity.json first, then model.onnx
    renamed from a temp name, so a model.onnx is always complete; stale outputs of an earlier export are removed
    before anything else happens, and those in place when a later step fails are removed again.
    card_maker(model_path) reads the model card's records before any work (an error there leaves no output) and
    returns (card(meta, result) -> the card's text (model_card.py), made after the checks passed and written with
    the outputs, and whether the run trained under train.privacy, from its history); publish(onnx_path, meta, result, example_u8, card_text), if given, runs after it and
    before the outputs appear (the stage logs the model to MLflow there). `traces`: as export_onnx's.
    int8 (quantize.Int8Settings), if given: also out/model.int8.onnx, calibrated on the shards' source domains and
    gated on the held-out images after the parity check (quantize.checked_int8; its figures under parity.json's
    "int8"); a refused copy (Int8Refused) leaves no output, as a failed parity check does."""
    import sys

    from fedccrl_core.foundation.fsio import atomic_path, write_text
    from fedccrl_serving.metadata import card_path, int8_path

    final_onnx, final_parity, final_card = out / ONNX_FILE, out / PARITY_FILE, card_path(out / ONNX_FILE)
    outputs = (final_onnx, final_parity, int8_path(final_onnx), final_card)
    _remove(outputs)  # as DVC does: a failed export leaves no earlier output behind
    card, model, meta, (x, y), private = _checked_inputs(model_path, shards, card_maker, int8, study_images)
    # renamed to model.onnx after the card and parity.json (and model.int8.onnx, when asked for) are written; a
    # failure on the way removes those already in place (_all_or_none)
    with _all_or_none(outputs), atomic_path(final_onnx) as tmp_onnx, contextlib.ExitStack() as int8_out:
        export_onnx(model, meta, tmp_onnx, traces=traces)
        result = _parity_checked(tmp_onnx, model, meta, (x, y), min_agreement, batch_size)
        if int8 is not None:
            from fedccrl_pipeline.quantize import checked_int8

            tmp_int8 = int8_out.enter_context(atomic_path(int8_path(final_onnx)))
            assert meta.held_out_domain and shards and y is not None  # require(), the check above
            gate = checked_int8(tmp_onnx, tmp_int8, shards, meta.held_out_domain, (x, y), int8, batch_size, private)
            # under the name it is renamed to, not the temporary one it was written under
            result = dataclasses.replace(result, int8=dataclasses.replace(gate, file=int8_path(final_onnx).name))
        text = card(meta, result)
        if publish is not None:
            publish(tmp_onnx, meta, result, example_images(x), text)
        write_text(final_card, text)
        write_text(final_parity, json.dumps(result.to_dict(), indent=1) + "\n")
    print(f"wrote {final_onnx} ({result.onnx_bytes / 1e6:.1f} MB), {final_parity} and {final_card}", file=sys.stderr)
    if int8 is not None:
        print(f"wrote {int8_path(final_onnx)} ({int8_path(final_onnx).stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return result
