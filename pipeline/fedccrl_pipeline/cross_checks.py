"""The held-out check and the form of a problem line, shared by params.yaml's checks that involve more than one key
(params.py's check_config, run after the typed validation) and the train stage, which runs the held-out check again
against the manifest (for imagefolder). One line per problem. It imports nothing of params.py."""

from __future__ import annotations

from typing import Any


def problem_line(key: str, value: Any, what: str) -> str:
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
                    problem_line(
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
                problem_line(where, h, f"must be a domain of {of}: {', '.join(domains)} (or its index in that order)")
            )
            continue
        if name in seen:
            problems.append(
                problem_line(
                    where,
                    h,
                    f"names domain {name} as {seen[name]!r} does (each entry is one DVC stage and one MLflow run)",
                )
            )
        seen.setdefault(name, h)
        names.append(name)
    return names, problems
