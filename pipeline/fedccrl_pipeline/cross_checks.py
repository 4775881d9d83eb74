"""params.yaml's checks that involve more than one key (pipeline/fedccrl_pipeline/params.py runs them after the typed validation):
held-out entries against a dataset's domains (the one held-out check: the train stage runs it again against the
manifest, for imagefolder), dataset.source 'registry' and dataset.sha256 against what the registry has, the
backbone against `pretrained`, and what an algorithm to be trained needs of its own group. One line per problem."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedccrl_core.data.registry import AUTO, LAYOUT_GENERATED, REGISTRY

if TYPE_CHECKING:
    from fedccrl_pipeline.params import ParamsFile


def _line(key: str, value: Any, what: str) -> str:
    return f"params.yaml: key '{key}': got {value!r}; {what}"


def resolve_held_out(
    domains: list[str], entries: list, of: str, key: str = "train.held_out"
) -> tuple[list[str], list[str]]:
    """Held-out entries (names, or indices into `domains`) -> (the domain names, one problem line per entry that is
    not a domain of `of` or names a domain an earlier entry names). The one check of held-out entries: against
    the registry's domains when params.yaml is validated, against the manifest's in the train stage."""
    names, problems = [], []
    seen: dict[str, int | str] = {}  # domain: the entry that names it
    for i, h in enumerate(entries):
        where = f"{key}[{i}]" if key == "train.held_out" else key
        if isinstance(h, int) and not isinstance(h, bool):
            if not 0 <= h < len(domains):
                problems.append(
                    _line(
                        where,
                        h,
                        f"{of} has {len(domains)} domains, indices "
                        + ", ".join(f"{j}={d}" for j, d in enumerate(domains)),
                    )
                )
                continue
            name = domains[h]
        elif isinstance(h, str) and h in domains:
            name = h
        else:
            problems.append(
                _line(where, h, f"must be a domain of {of}: {', '.join(domains)} (or its index in that order)")
            )
            continue
        if name in seen:
            problems.append(
                _line(
                    where,
                    h,
                    f"names domain {name} as {seen[name]!r} does (each entry is one DVC stage and one MLflow run)",
                )
            )
        seen.setdefault(name, h)
        names.append(name)
    return names, problems


def check_config(cfg: ParamsFile, run_algorithms: tuple[str, ...] = (), downloads: bool = True) -> list[str]:
    """Problems that involve more than one key: held_out against the dataset's domains, the backbone against
    `pretrained`, and what an algorithm to be trained (listed in train.algorithms, or `run_algorithms`: a stage's
    --algorithm) needs of its own group. One line each. `downloads=False`: a command that reads its images from
    elsewhere (a site's `--images`), for which dataset.source does not apply."""
    out = []
    spec = REGISTRY[cfg.dataset.name]
    if cfg.dataset.source == "registry" and downloads:  # what the registry has to give (fedccrl_core/data/sources.py)
        if spec.layout == LAYOUT_GENERATED and cfg.dataset.sha256 is not None:
            out.append(
                _line("dataset.sha256", cfg.dataset.sha256, f"does not apply to the generated dataset {spec.name!r}")
                + ": set it to null"
            )
        elif spec.layout != LAYOUT_GENERATED and not spec.sources:
            out.append(
                _line(
                    "dataset.source",
                    "registry",
                    f"the registry has no download for {spec.name!r}: set dataset.source to a URL, an archive or a "
                    "folder",
                )
            )
    if spec.domains:  # imagefolder discovers its domains: checked against the manifest by the train stage
        out += resolve_held_out(list(spec.domains), cfg.train.held_out, spec.name)[1]
    backbone = spec.backbone if cfg.model.backbone == AUTO else cfg.model.backbone
    pretrained = spec.pretrained if cfg.model.pretrained == AUTO else cfg.model.pretrained
    if backbone == "small_cnn" and pretrained != "none":
        out.append(
            _line(
                "model.pretrained",
                cfg.model.pretrained,
                f"{backbone} (model.backbone {cfg.model.backbone!r}) has no pretrained weights: use none"
                + (" or auto" if spec.pretrained == "none" else ""),
            )
        )
    for name in dict.fromkeys([*cfg.train.algorithms, *run_algorithms]):
        group = getattr(cfg.train, name)
        out += group.selected_problems(f"train.{name}")
        if cfg.train.privacy.enabled and type(group).dp_refusal:
            out.append(
                _line(
                    "train.privacy.enabled",
                    True,
                    f"{name} cannot train under train.privacy: {type(group).dp_refusal}. Set train.privacy.enabled "
                    f"to false, or leave {name} out of train.algorithms",
                )
            )
            continue
        out += [
            _line(key, getattr(cfg.train.privacy, key.rsplit(".", 1)[1]), why)
            for key, why in cfg.train.privacy.unprotected(name, getattr(type(group), "uploads_statistics", False))
        ]
    return out
