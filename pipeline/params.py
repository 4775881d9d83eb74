"""params.yaml: one typed model of the whole file, validated at the start of every stage, before any data is
read and before any MLflow run is opened.

Each group is a pydantic model (fedccrl_core/hparams.py: strict types, unknown keys refused). `train.<algorithm>`
is that algorithm's own declaration (`Algorithm.Params`), `train.flower` the Flower engine's
(fedccrl_flower/settings.py): nothing here repeats them. Every problem becomes one line naming the key, the
value and what is allowed (ParamError); `fedccrl <stage>` prints each as `error: ...` and exits 2.

`train.held_out` lists domains by name (`[sketch]`) or by index. Indices follow the manifest's domain order:
the dataset registry's order for a registered dataset (fedccrl_core/data/registry.py: synthetic photo, art,
cartoon, sketch; PACS photo, art_painting, cartoon, sketch; ...), sorted folder names for `imagefolder`.
An entry is also the run's name: models/<algorithm>/s<seed>/d<entry> (d3 or dsketch).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import Field, create_model, field_validator

from fedccrl_core import contract
from fedccrl_core.algorithms import ALGORITHMS
from fedccrl_core.data.registry import AUTO, REGISTRY
from fedccrl_core.data.shards import SCHEMES
from fedccrl_core.errors import ParamError
from fedccrl_core.hparams import Declared, validate
from fedccrl_core.models import BACKBONES
from fedccrl_core.privacy.settings import PrivacySettings
from fedccrl_flower.settings import FlowerSettings

__all__ = ["ParamError", "ParamsFile", "load_config", "load_params", "check_config", "held_out_entry",
           "resolve_held_out", "check_batches", "check_train", "run_dirs"]

_MISSING = object()


def _one_of(values) -> Any:
    return Literal[tuple(values)]  # type: ignore[valid-type]


def _unique(v: list) -> list:
    repeats = sorted({repr(x) for x in v if v.count(x) > 1})
    if repeats:
        raise ValueError(f"{', '.join(repeats)} listed more than once (each entry is one DVC stage and one MLflow run)")
    return v


# ---- the groups, in params.yaml's order ------------------------------------------------------------------------
class DatasetParams(Declared):
    name: _one_of(REGISTRY)  # type: ignore[valid-type]
    source: str = Field("registry", min_length=1)
    sha256: str | dict[str, str] | None = None
    seed: int = 0


class DownloadParams(Declared):
    timeout_s: float = Field(gt=0)
    deadline_s: float = Field(3600.0, gt=0, description="the whole download of one archive, retries included")
    retries: int = Field(ge=0)
    max_bad_fraction: float = Field(ge=0, le=1)

    @field_validator("deadline_s")
    @classmethod
    def _deadline_covers_a_read(cls, v, info):
        t = info.data.get("timeout_s")
        if t is not None and v < t:
            raise ValueError(f"must be >= download.timeout_s={t:g}: it bounds the whole download of one archive")
        return v


class PreprocessParams(Declared):
    image_size: Union[Literal["auto"], Annotated[int, Field(ge=8)]]
    mean: Annotated[list[float], Field(min_length=3, max_length=3)]
    std: Annotated[list[Annotated[float, Field(gt=0)]], Field(min_length=3, max_length=3)]


class PartitionParams(Declared):
    clients_per_domain: int = Field(ge=1)
    # 1 leaves a client no training samples; 0 no source validation, so train's best-val model (best.pt) would be
    # the untrained round-0 model and evaluate's best_val_target_acc meaningless
    val_fraction: float = Field(gt=0, lt=1)
    dirichlet_alpha: float | None = Field(None, gt=0)
    seed: int
    num_clients: int | None = Field(None, ge=1)
    lambda_: float | None = Field(None, alias="lambda", ge=0, le=1)
    scheme: _one_of(SCHEMES) = "per_domain"  # type: ignore[valid-type]

    @field_validator("scheme")
    @classmethod
    def _feddg_bench_needs(cls, v, info):
        if v == "feddg_bench":
            missing = [k for k, f in (("num_clients", "num_clients"), ("lambda", "lambda_"))
                       if f not in info.data or info.data[f] is None]
            if missing:
                raise ValueError(f"feddg_bench needs partition.{missing[0]}")
        return v


class ModelParams(Declared):
    backbone: _one_of((AUTO, *BACKBONES))  # type: ignore[valid-type]
    pretrained: str = Field(min_length=1, description="auto | imagenet | none | <path to a torchvision state_dict>")


HeldOut = Union[Annotated[int, Field(ge=0)], Annotated[str, Field(min_length=1)]]


class TrainSweep(Declared):
    """train.*: the DVC matrix (algorithms x seeds), the held-out domains each train stage covers, and the
    settings every algorithm shares."""

    held_out: Annotated[list[HeldOut], Field(min_length=1)]
    algorithms: Annotated[list[_one_of(ALGORITHMS)], Field(min_length=1)]  # type: ignore[valid-type]
    seeds: Annotated[list[int], Field(min_length=1)]
    engine: Literal["inprocess", "flower"]
    flower: FlowerSettings = Field(default_factory=FlowerSettings)
    device: Literal["auto", "cpu", "cuda"]
    rounds: int = Field(ge=1)
    local_epochs: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    lr: float = Field(gt=0)
    weight_decay: float = Field(ge=0)
    lr_schedule: Literal["cosine", "constant"]
    client_fraction: float = Field(gt=0, le=1)
    fast: bool = True
    concurrent_clients: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    client_state: Literal["persistent", "stateless"] = "persistent"
    privacy: PrivacySettings = Field(default_factory=PrivacySettings)  # differential privacy, off by default

    @field_validator("held_out", "algorithms", "seeds")
    @classmethod
    def _no_repeats(cls, v):
        return _unique(v)


# train.<algorithm>: each algorithm's own declaration (absent or partial groups take the declared defaults)
TrainParams = create_model("TrainParams", __base__=TrainSweep,
                           **{name: (cls.Params, Field(default_factory=cls.Params)) for name, cls in ALGORITHMS.items()})


class EvaluateParams(Declared):
    batch_size: int = Field(ge=1)


class ExportParams(Declared):
    min_agreement: float = Field(ge=0, le=1)
    batch_size: int = Field(ge=1)


class FiguresParams(Declared):
    seed: int
    preview_images: int = Field(ge=1)
    tsne_points: int = Field(ge=3)  # t-SNE's perplexity (>= 2) must stay below the number of points
    gradcam_images: int = Field(ge=1)


class TrackingParams(Declared):
    system_metrics: bool = Field(True, description="MLflow system metrics (CPU, RAM, GPU where present) on each "
                                 "training run")
    system_metrics_interval_s: float = Field(10.0, gt=0, description="seconds between two samples")


class ParamsFile(Declared):
    dataset: DatasetParams
    download: DownloadParams
    preprocess: PreprocessParams
    partition: PartitionParams
    model: ModelParams
    train: TrainParams  # type: ignore[valid-type]
    evaluate: EvaluateParams
    export: ExportParams
    figures: FiguresParams
    tracking: TrackingParams = Field(default_factory=TrackingParams)


# ---- checks across groups ----------------------------------------------------------------------------------------
def _line(key: str, value: Any, what: str) -> str:
    return f"params.yaml: key '{key}': got {value!r}; {what}"


def check_config(cfg: ParamsFile, run_algorithms: tuple[str, ...] = ()) -> list[str]:
    """Problems that involve more than one key: held_out against the dataset's domains, the backbone against
    `pretrained`, and what an algorithm to be trained (listed in train.algorithms, or `run_algorithms`: a stage's
    --algorithm) needs of its own group. One line each."""
    out = []
    spec = REGISTRY[cfg.dataset.name]
    if spec.domains:  # imagefolder discovers its domains: checked against the manifest by the train stage
        seen: dict[str, Any] = {}
        for i, h in enumerate(cfg.train.held_out):
            key = f"train.held_out[{i}]"
            if isinstance(h, int) and h >= len(spec.domains):
                out.append(_line(key, h, f"{spec.name} has {len(spec.domains)} domains, indices "
                                         + ", ".join(f"{j}={d}" for j, d in enumerate(spec.domains))))
                continue
            if isinstance(h, str) and h not in spec.domains:
                out.append(_line(key, h, f"must be a domain of {spec.name}: {', '.join(spec.domains)} "
                                         "(or its index in that order)"))
                continue
            name = spec.domains[h] if isinstance(h, int) else h
            if name in seen:
                out.append(_line(key, h, f"names domain {name} as {seen[name]!r} does (each entry is one DVC stage "
                                         "and one MLflow run)"))
            seen.setdefault(name, h)
    backbone = spec.backbone if cfg.model.backbone == AUTO else cfg.model.backbone
    pretrained = spec.pretrained if cfg.model.pretrained == AUTO else cfg.model.pretrained
    if backbone == "small_cnn" and pretrained != "none":
        out.append(_line("model.pretrained", cfg.model.pretrained,
                         f"{backbone} (model.backbone {cfg.model.backbone!r}) has no pretrained weights: use none"
                         + (" or auto" if spec.pretrained == "none" else "")))
    for name in dict.fromkeys([*cfg.train.algorithms, *run_algorithms]):
        out += getattr(cfg.train, name).selected_problems(f"train.{name}")
    return out


# ---- loading -------------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats as DVC (ruamel) reads them: `1e-3` is a number, not the string PyYAML's 1.1 makes of it."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def read_yaml(path: str | Path = "params.yaml") -> dict:
    path = Path(path)
    if not path.is_file():
        raise ParamError(f"{path}: params file not found (run from the repository root)")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ParamError(f"{path}: not valid YAML ({e.__class__.__name__})") from e
    if not isinstance(data, dict):
        raise ParamError(f"{path}: top level must be a mapping of stage groups")
    return data


def validate_params(data: dict, run_algorithms: tuple[str, ...] = ()) -> ParamsFile:
    """The whole file, typed; ParamError listing every problem (one line each). `run_algorithms`: registered
    algorithms a stage trains besides train.algorithms (`fedccrl train --algorithm`, `bench-accuracy`)."""
    cfg = validate(ParamsFile, data)
    problems = check_config(cfg, tuple(run_algorithms))
    if problems:
        raise ParamError(*problems)
    return cfg


def load_config(path: str | Path = "params.yaml") -> ParamsFile:
    return validate_params(read_yaml(path))


def load_params(path: str | Path = "params.yaml") -> dict:
    """params.yaml as read (a plain dict), after the whole file has validated."""
    data = read_yaml(path)
    validate_params(data)
    return data


def get(params: dict, key: str, default: Any = _MISSING) -> Any:
    """Dotted lookup in a validated params dict: get(p, "train.flower")."""
    node: Any = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is not _MISSING:
                return default
            raise ParamError(f"params.yaml: key '{key}' is missing")
        node = node[part]
    return node


# ---- the sweep's runs --------------------------------------------------------------------------------------------
def held_out_entry(text: str | int) -> int | str:
    """A held-out domain as the train stage's --held-out gives it (DVC passes ${item.held_out}): an index or a name."""
    if isinstance(text, int):
        return text
    return int(text) if re.fullmatch(r"[0-9]+", text) else text


def resolve_held_out(manifest: dict, entries: list, key: str = "train.held_out") -> list[str]:
    """Held-out entries (names or indices into the manifest's domains) -> domain names; ParamError naming the entry
    for one that is not a domain or repeats another (checked here for imagefolder, whose domains only the data
    knows)."""
    doms = list(manifest["domains"])
    names, problems = [], []
    for i, h in enumerate(entries):
        where = f"params.yaml: key '{key}[{i}]'" if key == "train.held_out" else key
        if isinstance(h, int) and not isinstance(h, bool) and 0 <= h < len(doms):
            name = doms[h]
        elif isinstance(h, str) and h in doms:
            name = h
        else:
            problems.append(f"{where}: got {h!r}; must be a domain of the shards ({manifest.get('dataset')}): "
                            + ", ".join(f"{j}={d}" for j, d in enumerate(doms)) + " (a name or its index)")
            continue
        if name in names:
            problems.append(f"{where}: got {h!r}; names domain {name} a second time")
        names.append(name)
    if problems:
        raise ParamError(*problems)
    return names


def check_batches(manifest: dict, target: str, batch_size: int, key: str) -> None:
    """Every source client must get a batch of >= 2 samples (BatchNorm, which every backbone has, cannot train on
    one; the local loop skips such batches, so the client would train nothing). From the manifest's counts only,
    before any shard is read."""
    if batch_size < 2:
        raise ParamError(f"params.yaml: key '{key}': got {batch_size}; must be >= 2 for a BatchNorm model "
                         "(a batch of 1 trains nothing)")
    for c in manifest["clients"]:
        counts = c.get("train_domain_counts") or {c["domain"]: c["n_train"]}
        n = sum(v for d, v in counts.items() if d != target)
        if 0 < n < 2:
            raise ParamError(f"data/shards manifest: client {c['id']} has {n} training sample without the held-out "
                             f"domain {target}; BatchNorm needs a batch of at least 2 (fewer "
                             "partition.clients_per_domain or a lower partition.val_fraction)")


def check_train(params: dict, manifest: dict, algorithm: str, held_out: list) -> list[str]:
    """Everything a train run is checked against before any shard is read and before MLflow: the held-out entries
    it trains (`--held-out` values: names or indices) and train.held_out against the manifest's domains, and every
    source client's BatchNorm batch under the batch size the algorithm trains with (FedBN's own 64 replaces
    train.batch_size). `params` has passed validate_params(params, (algorithm,)). Returns the held-out domains'
    names, in the order given."""
    from fedccrl_core.algorithms import LocalConfig, build_algorithm

    resolve_held_out(manifest, params["train"]["held_out"])
    targets = resolve_held_out(manifest, [held_out_entry(h) for h in held_out], key="--held-out")
    alg = build_algorithm(algorithm, LocalConfig(batch_size=params["train"]["batch_size"]),
                          params["train"].get(algorithm))
    # an algorithm whose own batch_size replaces train.batch_size (local_bn.py: FedBN, SiloBN, FedFD(-A))
    key = f"train.{algorithm}.batch_size" if alg.hp.get("batch_size") is not None else "train.batch_size"
    for target in targets:
        check_batches(manifest, target, alg.local.batch_size, key)
        if params["train"].get("engine") == "flower":
            from fedccrl_core.data.shards import client_ids

            FlowerSettings.from_mapping(params["train"].get("flower")).require_clients(
                len(client_ids(manifest, target)), target)
    return targets


def run_dirs(cfg: ParamsFile, root: Path) -> list[Path]:
    """Every run of the sweep, in dvc.yaml's layout: <root>/<algorithm>/s<seed>/d<held_out entry>."""
    return [contract.run_dir(root, a, s, h) for a in cfg.train.algorithms for s in cfg.train.seeds
            for h in cfg.train.held_out]
