"""Dataset registry: what each dataset is, where it comes from, and what a complete copy holds.

One frozen `DatasetSpec` per dataset. `domains` is in REGISTRY ORDER, which is the held-out index
order of `train.held_out` (index 0 = first domain). For PACS this is the paper's table order
P, A, C, S; for OfficeHome A, C, P, R; for miniDomainNet C, P, R, S (FedCCRL Table 1).

What is known and what is derived
---------------------------------
- PACS (Li et al., ICCV 2017): domains, the 7 classes and the per-domain counts P 1,670,
  A 2,048, C 2,344, S 3,929 (9,991) are facts checked on every download. The public source is
  DomainBed's Google-Drive zip (top folder `kfold/`); its sha256 is NOT known to this project,
  so a download computes it, writes it to the report and asks the user to pin `dataset.sha256`.
  The two local copies under shared/datasets/pacs have known sha256 values (`known_archives`).
- OfficeHome (Venkateswara et al., CVPR 2017): 4 domains, the standard 65 classes and the
  per-domain counts Art 2,427, Clipart 4,365, Product 4,439, Real World 4,357 (15,588) are facts.
  The domain folder is `Real World` in the official zip and `Real_World` in many copies; the
  registry names it `Real_World` (no space: it becomes a file name and a client id) and accepts
  `Real World` / `RealWorld` as aliases. Source: DomainBed's Google-Drive zip (sha256 unknown).
- miniDomainNet (Zhou et al., "Domain adaptive ensemble learning", the `splits_mini` files of
  Dassl): 4 domains clipart, painting, real, sketch (FedCCRL Table 1 columns C P R S; the paper's
  prose says "Infograph", which contradicts its own table and Dassl's miniDomainNet), 126
  classes and 140,006 images in total (train + test split files; FedCCRL Sec. 4.1). KNOWN and
  checked: the domains and the total. DERIVED at download time: the class list (from the class
  folder named in each split line) and the per-domain counts. Recalled but NOT checked (not
  verifiable here): clipart 18,703, painting 31,202, real 65,609, sketch 24,492 (they do sum to
  140,006). Sources: the four DomainNet (cleaned) domain zips from csr.bu.edu and Dassl's
  `splits_mini.zip` on Google Drive; no sha256 is known for any of them.
- imagefolder: any `<domain>/<class>/<image>` tree a user brings; domains (sorted) and classes
  are discovered; every domain must have the same class set.
- synthetic: generated offline (see `synthetic.py`); everything about it is known exactly.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from dataclasses import dataclass, field

# layout kinds: how a source's extracted tree maps onto <domain>/<class>/<image>
LAYOUT_FOLDERS = "folders"  # <root>/<domain>/<class>/<image>
LAYOUT_SPLIT_FILES = "split_files"  # Dassl miniDomainNet: <root>/splits_mini/<domain>_{train,test}.txt
LAYOUT_GENERATED = "generated"  # synthetic.py writes the tree itself

AUTO = "auto"


def gdrive_url(file_id: str) -> str:
    """Direct-download URL of a public Google-Drive file (skips the large-file confirmation page)."""
    return f"https://drive.usercontent.google.com/download?id={file_id}&export=download&confirm=t"


@dataclass(frozen=True)
class Source:
    """One downloadable archive. sha256 None = unknown (computed, reported, to be pinned by the user)."""

    url: str
    sha256: str | None
    folder: str | None  # dataset root folder inside the archive (informative; the root is also searched)
    filename: str  # name to report the archive under
    note: str = ""


@dataclass(frozen=True)
class KnownArchive:
    """An archive whose sha256 is known (e.g. the project's local copies); recognized by its hash."""

    sha256: str
    filename: str
    note: str


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    domains: tuple[str, ...]  # registry order = held-out index order; () = discovered (sorted)
    classes: tuple[str, ...] | None  # sorted; None = derived from the data
    domain_counts: tuple[int, ...] | None  # aligned with domains; None = not checked per domain
    total: int | None  # None = not checked
    sources: tuple[Source, ...]  # the `registry` source; () = none (generated or user-provided)
    image_size: int
    backbone: str
    pretrained: str
    layout: str = LAYOUT_FOLDERS
    domain_aliases: tuple[tuple[str, str], ...] = ()  # (folder name seen in archives, registry domain)
    known_archives: tuple[KnownArchive, ...] = ()
    citation: str = ""
    notes: tuple[str, ...] = field(default=())
    expected_num_classes: int | None = None  # checked when classes are derived (miniDomainNet: 126)

    @property
    def discovered(self) -> bool:
        """True when domains are discovered from the data (imagefolder)."""
        return not self.domains

    @property
    def num_classes(self) -> int | None:
        return len(self.classes) if self.classes is not None else self.expected_num_classes

    def expected_count(self, domain: str) -> int | None:
        if self.domain_counts is None:
            return None
        return self.domain_counts[self.domains.index(domain)]

    def canonical_domain(self, folder_name: str) -> str | None:
        """Registry domain name for an archive folder name (exact, alias, or case-insensitive); None if none."""
        if folder_name in self.domains:
            return folder_name
        for alias, canon in self.domain_aliases:
            if folder_name == alias:
                return canon
        low = folder_name.lower().replace(" ", "_")
        for d in self.domains:
            if d.lower() == low:
                return d
        for alias, canon in self.domain_aliases:
            if alias.lower().replace(" ", "_") == low:
                return canon
        return None

    def known_archive(self, sha256: str) -> KnownArchive | None:
        for k in self.known_archives:
            if k.sha256 == sha256:
                return k
        for s in self.sources:
            if s.sha256 == sha256:
                return KnownArchive(s.sha256, s.filename, f"registry source {s.url}")
        return None


PACS = DatasetSpec(
    name="pacs",
    domains=("photo", "art_painting", "cartoon", "sketch"),
    classes=("dog", "elephant", "giraffe", "guitar", "horse", "house", "person"),
    domain_counts=(1670, 2048, 2344, 3929),
    total=9991,
    sources=(
        Source(
            url=gdrive_url("1JFr8f805nMUelQWWmfnJR3y4_SYoN5Pd"),
            sha256=None,
            folder="kfold",
            filename="PACS.zip",
            note="DomainBed's PACS zip (top folder kfold/)",
        ),
    ),
    image_size=224,
    backbone="mobilenet_v3_large",
    pretrained="imagenet",
    known_archives=(
        KnownArchive(
            "3b45ceb3d20879e94e1104dfe2ab4c4845740076989ed6ad8523c9c94169b4f7",
            "pacs_224.zip",
            "local copy, 224x224 JPEG q90, layout PACS/<domain>/<class>/",
        ),
        KnownArchive(
            "0239f4e21fc401b5da9ccc497cdafe8064b81c9e918613c7ebba92b72547f578",
            "pacs_128.zip",
            "local copy, 128x128 JPEG q85, layout PACS/<domain>/<class>/",
        ),
    ),
    citation="Li et al., Deeper, Broader and Artier Domain Generalization, ICCV 2017",
)

OFFICEHOME_CLASSES = (
    "Alarm_Clock",
    "Backpack",
    "Batteries",
    "Bed",
    "Bike",
    "Bottle",
    "Bucket",
    "Calculator",
    "Calendar",
    "Candles",
    "Chair",
    "Clipboards",
    "Computer",
    "Couch",
    "Curtains",
    "Desk_Lamp",
    "Drill",
    "Eraser",
    "Exit_Sign",
    "Fan",
    "File_Cabinet",
    "Flipflops",
    "Flowers",
    "Folder",
    "Fork",
    "Glasses",
    "Hammer",
    "Helmet",
    "Kettle",
    "Keyboard",
    "Knives",
    "Lamp_Shade",
    "Laptop",
    "Marker",
    "Monitor",
    "Mop",
    "Mouse",
    "Mug",
    "Notebook",
    "Oven",
    "Pan",
    "Paper_Clip",
    "Pen",
    "Pencil",
    "Postit_Notes",
    "Printer",
    "Push_Pin",
    "Radio",
    "Refrigerator",
    "Ruler",
    "Scissors",
    "Screwdriver",
    "Shelf",
    "Sink",
    "Sneakers",
    "Soda",
    "Speaker",
    "Spoon",
    "TV",
    "Table",
    "Telephone",
    "ToothBrush",
    "Toys",
    "Trash_Can",
    "Webcam",
)

OFFICEHOME = DatasetSpec(
    name="officehome",
    domains=("Art", "Clipart", "Product", "Real_World"),
    classes=OFFICEHOME_CLASSES,
    domain_counts=(2427, 4365, 4439, 4357),
    total=15588,
    sources=(
        Source(
            url=gdrive_url("1uY0pj7oFsjMxRwaD3Sxy0jgel0fsYXLC"),
            sha256=None,
            folder="OfficeHomeDataset_10072016",
            filename="office_home.zip",
            note="DomainBed's OfficeHome zip",
        ),
    ),
    image_size=224,
    backbone="mobilenet_v3_large",
    pretrained="imagenet",
    domain_aliases=(("Real World", "Real_World"), ("RealWorld", "Real_World")),
    citation="Venkateswara et al., Deep Hashing Network for Unsupervised Domain Adaptation, CVPR 2017",
)

_DOMAINNET = "http://csr.bu.edu/ftp/visda/2019/multi-source"
MINIDOMAINNET = DatasetSpec(
    name="minidomainnet",
    domains=("clipart", "painting", "real", "sketch"),
    classes=None,  # derived from splits_mini (126 classes)
    domain_counts=None,  # derived; see the module docstring for the recalled, unchecked values
    total=140006,
    sources=(
        Source(f"{_DOMAINNET}/groundtruth/clipart.zip", None, None, "clipart.zip", "DomainNet cleaned"),
        Source(f"{_DOMAINNET}/groundtruth/painting.zip", None, None, "painting.zip", "DomainNet cleaned"),
        Source(f"{_DOMAINNET}/real.zip", None, None, "real.zip", "DomainNet"),
        Source(f"{_DOMAINNET}/sketch.zip", None, None, "sketch.zip", "DomainNet"),
        Source(
            gdrive_url("15rrLDCrzyi6ZY-1vJar3u7plgLe4COL7"),
            None,
            "splits_mini",
            "splits_mini.zip",
            "Dassl's miniDomainNet split files",
        ),
    ),
    image_size=128,
    backbone="mobilenet_v3_large",
    pretrained="imagenet",
    layout=LAYOUT_SPLIT_FILES,
    citation="Zhou et al., Domain Adaptive Ensemble Learning, IEEE TIP 2021 (miniDomainNet); "
    "Peng et al., Moment Matching for Multi-Source Domain Adaptation, ICCV 2019 (DomainNet)",
    expected_num_classes=126,
)

IMAGEFOLDER = DatasetSpec(
    name="imagefolder",
    domains=(),
    classes=None,
    domain_counts=None,
    total=None,
    sources=(),
    image_size=224,
    backbone="mobilenet_v3_large",
    pretrained="imagenet",
    notes=("domains (sorted) and classes are discovered; every domain must hold the same classes",),
)


def _synthetic_spec() -> DatasetSpec:
    from fedccrl_core.data import synthetic

    n = synthetic.IMAGES_PER_CLASS * len(synthetic.CLASSES)
    return DatasetSpec(
        name="synthetic",
        domains=synthetic.DOMAINS,
        classes=tuple(sorted(synthetic.CLASSES)),
        domain_counts=tuple(n for _ in synthetic.DOMAINS),
        total=n * len(synthetic.DOMAINS),
        sources=(),
        image_size=32,
        backbone="small_cnn",
        pretrained="none",
        layout=LAYOUT_GENERATED,
        citation="generated by fedccrl_core.data.synthetic from dataset.seed",
    )


SYNTHETIC = _synthetic_spec()

REGISTRY: dict[str, DatasetSpec] = {s.name: s for s in (SYNTHETIC, PACS, OFFICEHOME, MINIDOMAINNET, IMAGEFOLDER)}


def dataset_names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get_dataset(name: str) -> DatasetSpec:
    """The registry entry for `name` (params.yaml dataset.name: its schema allows the registry's names only)."""
    return REGISTRY[name]


# The three `auto` settings of params.yaml, resolved from the registry. The values are the schema's
# (pipeline/fedccrl_pipeline/params.py: image_size 'auto' or an int >= 8, a backbone name, a non-empty pretrained).
def resolve_image_size(value: int | str, dataset: str | DatasetSpec) -> int:
    """preprocess.image_size: `auto` -> the registry default; else the int itself."""
    spec = dataset if isinstance(dataset, DatasetSpec) else get_dataset(dataset)
    return spec.image_size if value == AUTO else int(value)


def resolve_backbone(value: str, dataset: str | DatasetSpec) -> str:
    """model.backbone: `auto` -> the registry default (synthetic: small_cnn, others: mobilenet_v3_large)."""
    spec = dataset if isinstance(dataset, DatasetSpec) else get_dataset(dataset)
    return spec.backbone if value == AUTO else value


def resolve_pretrained(value: str, dataset: str | DatasetSpec) -> str:
    """model.pretrained: `auto` -> the registry default (synthetic: none, others: imagenet)."""
    spec = dataset if isinstance(dataset, DatasetSpec) else get_dataset(dataset)
    return spec.pretrained if value == AUTO else value
