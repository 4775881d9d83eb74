"""The study ledger: every release of every run that trains on one set of images, in one append-only file, so that
an image's epsilon composes across runs wherever they train (another parent run, a queued DVC experiment in its
workspace copy, a deployment, an attempt that crashed and a rerun after a code change; docs/privacy.md, "One
ledger per study").

A study is one set of images (the shards' manifest, or a deployment's federation file: its hash, `data`) and,
optionally, a name (train.privacy.study) that starts a new study on the same images on purpose. Its file
<study_dir>/<study key>.jsonl holds JSON lines, nothing executable: a header, then one line per release as the
round loop charges it (accountant.py RunPrivacy, its `on_release`), tagged with the run's key, its name, its
attempt and the domains it trains on:

    {"fedccrl_study": 1, "study": key, "data": hash, "name": name, "created": iso time}
    {"run_key": k, "run": name, "attempt": a, "trained_domains": [d...], "channel": c, "round": t,
     "population": n, "sample": k, "z": z, "release": "<ledger id>/<index>"}

Writers append under an exclusive `fcntl.flock` with one write per line (O_APPEND), so queued workers that
release at once lose no line; every line is validated on read, a bad one an error naming the file and the line.
The epsilon per image of domain d is the composition of every release of every attempt that trained on d
(sweep_epsilon.py per_image_epsilon: the same accountant).

The pipeline tells a run where its study ledger is by a pointer file beside its round checkpoint,
`<checkpoint>.study.json` (`StudyPointer`), which the process that runs the round loop reads (in-process, the
Flower ServerApp, a deployment's ServerApp on the SuperLink's host): no engine carries a path of its own. One
writer per run: the process that runs the round loop when it finds the pointer (`recorder`); else (a deployment's
ServerApp on a host without the operator's disk) `fedccrl federate`, from the releases the round records carry
(`append_reported`). `release` keys a line by its run's ledger (privacy/ledger_file.py: its id) and its index there,
so a release is counted once whoever reads it again.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from fedccrl_core.foundation.fsio import write_json
from fedccrl_core.foundation.records import Record, parse_record
from fedccrl_core.foundation.runkey import params_hash
from fedccrl_core.privacy.sweep_epsilon import SweepRun, ledger_releases, per_image_epsilon

SUFFIX = ".jsonl"  # a study's ledger: <study_dir>/<study key>.jsonl
POINTER_SUFFIX = ".study.json"  # beside a round checkpoint P: P.study.json


class StudyHeader(Record):
    """The first line: which study the file is."""

    fedccrl_study: Literal[1]
    study: str
    data: str  # the hash of what describes the images (the shards' manifest, the federation file)
    name: str  # train.privacy.study ("": the images' own study)
    created: str


class StudyEntry(Record):
    """One release of one attempt of one run, as the round loop charged it."""

    run_key: str
    run: str
    attempt: int = Field(ge=1)
    trained_domains: list[str]
    channel: Literal["statistics", "weights"]
    round: int = Field(ge=1)
    population: int = Field(ge=1)
    sample: int = Field(ge=1)
    z: float = Field(gt=0)
    # (release_key) the release's place in its run's own ledger, where it is known: a deployment's operator counts a
    # release its ServerApp reported once by it (append_reported); a line without one is never matched
    release: str | None = None

    @model_validator(mode="after")
    def _a_sample_of_the_population(self) -> StudyEntry:
        if self.sample > self.population:
            raise ValueError(f"a sample of {self.sample} out of {self.population}")
        return self

    def as_ledger(self) -> list:
        """accountant.py RunPrivacy.state()'s form of the release: [channel, round, population, sample, z]."""
        return [self.channel, self.round, self.population, self.sample, self.z]


class StudyPointer(Record):
    """<checkpoint>.study.json: the study a run's releases are appended to (written by the pipeline)."""

    fedccrl_study_pointer: Literal[1]
    ledger: str  # absolute path of the study's .jsonl
    study: str
    data: str
    name: str
    run: str
    trained_domains: list[str]


def study_key(data: str, name: str) -> str:
    """The study of the images described by hash `data`, named `name` ("" = the images' own study)."""
    return data if not name else f"{data}-{params_hash(name)[:8]}"


def pointer_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + POINTER_SUFFIX)


def write_pointer(checkpoint: Path, pointer: StudyPointer) -> None:
    write_json(pointer_path(checkpoint), pointer.to_dict())


def read_pointer(checkpoint: Path) -> StudyPointer | None:
    """The pointer beside `checkpoint`, None when there is none (a run outside the pipeline has no study)."""
    path = pointer_path(checkpoint)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a study pointer (not JSON: {e})") from None
    return parse_record(StudyPointer, data, str(path), ValueError)


def earlier_attempts(checkpoint: Path) -> list[Path]:
    """The other round checkpoints in `checkpoint`'s folder whose pointer names the same study and run: attempts of
    this run under another run key (a code change, another setting), whose client states are orphaned."""
    mine = read_pointer(checkpoint)
    if mine is None:
        return []
    out = []
    for other in sorted(checkpoint.parent.glob("*" + POINTER_SUFFIX)):
        path = other.with_name(other.name.removesuffix(POINTER_SUFFIX))
        theirs = read_pointer(path) if path != checkpoint else None
        if theirs is not None and (theirs.study, theirs.run) == (mine.study, mine.run):
            out.append(path)
    return out


def _parse_line(path: Path, i: int, line: str, model: type[Record]):
    where = f"{path}: line {i}"
    if not line.endswith("\n"):
        raise ValueError(f"{where}: cut short (no end of line: a writer died while writing it); remove that line")
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    return parse_record(model, data, where, ValueError)


def read_study(path: Path) -> tuple[StudyHeader | None, list[StudyEntry]]:
    """The header and every release of the study ledger at `path`, each line validated; (None, []) when there is
    no file yet. ValueError naming the file and the line of the first bad one."""
    if not path.is_file():
        return None, []
    with open(path, encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # no line read half-written
        lines = f.readlines()
    return _parse_lines(path, lines)


def _parse_lines(path: Path, lines: list[str]) -> tuple[StudyHeader | None, list[StudyEntry]]:
    if not lines:
        return None, []
    header = _parse_line(path, 1, lines[0], StudyHeader)
    return header, [_parse_line(path, i, line, StudyEntry) for i, line in enumerate(lines[1:], start=2)]


def append_lines(
    path: Path,
    header: StudyHeader,
    entries: list[StudyEntry],
    choose: Callable[[list[StudyEntry]], list[StudyEntry]] | None = None,
) -> list[StudyEntry]:
    """Append `entries` to the study ledger at `path` under an exclusive lock (writing `header` first when the file
    is new; refusing a file that is another study's): one write per line, O_APPEND, then fsync. With `choose`, what is
    appended is choose(the lines already there), decided under the same lock. Returns what was appended."""
    try:  # never through a symlink, never into a FIFO or device (O_NONBLOCK: a FIFO without a reader fails at once)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        raise ValueError(f"{path}: cannot append to this study ledger ({err.strerror}: a symlink or a FIFO?)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file: a study ledger is one")
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_size == 0:
            _write_line(fd, header)
        else:
            found = _first_header(path)  # unlocked read: this process holds the lock on another descriptor
            if found.study != header.study:
                raise ValueError(f"{path}: the study ledger of study {found.study}, not {header.study}")
        if choose is not None:
            with open(path, encoding="utf-8") as f:  # unlocked read, under this process's lock
                entries = choose(_parse_lines(path, f.readlines())[1])
        for e in entries:
            _write_line(fd, e)
        os.fsync(fd)
    finally:
        os.close(fd)  # the lock goes with it
    return entries


def _write_line(fd: int, record: Record) -> None:
    """One line, in one write as a rule (a short write, a full disk's, goes on where it stopped)."""
    data = memoryview((json.dumps(record.to_dict()) + "\n").encode())
    while data:
        data = data[os.write(fd, data) :]


def _first_header(path: Path) -> StudyHeader:
    with open(path, encoding="utf-8") as f:
        return _parse_line(path, 1, f.readline(), StudyHeader)


def header_of(pointer: StudyPointer) -> StudyHeader:
    return StudyHeader(
        fedccrl_study=1,
        study=pointer.study,
        data=pointer.data,
        name=pointer.name,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def next_attempt(entries: list[StudyEntry], run_key: str) -> int:
    """The attempt a run of key `run_key` starting now is: 1 + the attempts of that key the study recorded."""
    return 1 + max((e.attempt for e in entries if e.run_key == run_key), default=0)


def release_key(ledger_id: str, index: int) -> str:
    """StudyEntry.release of the release at `index` of the run ledger `ledger_id` (accountant.py RunPrivacy)."""
    return f"{ledger_id}/{index}"


def _entry(run_key: str, run: str, attempt: int, domains: list[str], release: list, key: str | None) -> StudyEntry:
    channel, rnd, population, sample, z = release
    fields = {"run_key": run_key, "run": run, "attempt": attempt, "trained_domains": list(domains)}
    fields |= {"channel": str(channel), "round": int(rnd), "population": int(population)}
    fields |= {"sample": int(sample), "z": float(z), **({"release": key} if key is not None else {})}
    return StudyEntry.model_validate(fields)


def recorder(pointer: StudyPointer, run_key: str, key_of: Callable[[], str] | None = None) -> Callable[[list], None]:
    """RunPrivacy.on_release for a run of key `run_key` in the study of `pointer`: each release ([channel, round,
    population, sample, z]) appended to the study ledger as it is charged, tagged with this attempt and, with
    `key_of`, with key_of() (release_key of the release just charged). The study's folder must exist (the pipeline
    creates it): a missing one is an error naming it, before any release."""
    path = Path(pointer.ledger)
    if not path.parent.is_dir():
        raise ValueError(f"{path.parent}: the study ledger's folder does not exist (train.privacy.study_dir)")
    header = header_of(pointer)
    append_lines(path, header, [])  # the header of a new study, or this study's file checked, before a release
    attempt = next_attempt(read_study(path)[1], run_key)

    def on_release(release: list) -> None:
        key = key_of() if key_of is not None else None
        append_lines(path, header, [_entry(run_key, pointer.run, attempt, pointer.trained_domains, release, key)])

    return on_release


def append_reported(pointer: StudyPointer, run_key: str, ledger_id: str, start: int, releases: list) -> list[int]:
    """Count in the study of `pointer` the releases a run of key `run_key` reported from index `start` of its ledger
    `ledger_id` (a deployment's round records, federation/round_record.py LedgerReleases), each once: a release whose
    key the study holds is skipped, decided under the ledger's lock (a record read twice, a resumed run's inherited
    releases). A new ledger of the run is a new attempt; one the study knows keeps its attempt. Returns the indices
    appended."""
    keys = [release_key(ledger_id, start + i) for i in range(len(releases))]

    def uncounted(entries: list[StudyEntry]) -> list[StudyEntry]:
        counted = {e.release for e in entries}
        prefix = f"{ledger_id}/"
        known = [e.attempt for e in entries if e.run_key == run_key and (e.release or "").startswith(prefix)]
        attempt = known[0] if known else next_attempt(entries, run_key)
        return [
            _entry(run_key, pointer.run, attempt, pointer.trained_domains, r, k)
            for r, k in zip(releases, keys, strict=True)
            if k not in counted
        ]

    added = append_lines(Path(pointer.ledger), header_of(pointer), [], uncounted)
    return [int(str(e.release).rsplit("/", 1)[1]) for e in added]


def study_runs(entries: list[StudyEntry]) -> list[SweepRun]:
    """The study's releases as SweepRuns, one per attempt of a run (run key, attempt)."""
    groups: dict[tuple[str, int], list[StudyEntry]] = {}
    for e in entries:
        groups.setdefault((e.run_key, e.attempt), []).append(e)
    return [
        SweepRun(
            f"{es[0].run} ({key[:8]}, attempt {attempt})",
            tuple(es[0].trained_domains),
            tuple(ledger_releases([e.as_ledger() for e in es])),
        )
        for (key, attempt), es in groups.items()
    ]


def study_epsilon(entries: list[StudyEntry], delta: float) -> dict[str, float]:
    """{domain: epsilon at `delta` of one image of that domain over every release the study recorded}."""
    return per_image_epsilon(study_runs(entries), delta)
