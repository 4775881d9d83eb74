"""Records that cross layers (a stage's manifest, a model file's meta, a round checkpoint, the Flower specs): typed,
each declared in the module that writes it, validated once where it is read from a file or a message, and handed
on typed, so that no reader past that point looks a key up by its name.

A record keeps the keys its writer gave, in declaration order, and only those (`to_dict`): a key that was absent
when read stays absent when written, so a record read and written back is the same data (a run's key hashes the
shard manifest).


Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from fedccrl_core.foundation.errors import DataError
from fedccrl_core.foundation.hparams import problems


class Record(BaseModel):
    """Strict (no coercion: "3" is not 3), closed (an unknown key is refused) and frozen."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data: the keys it was given (a key left out stays out), in declaration order, each by
        the name it is written under (its alias where it has one)."""
        return self.model_dump(by_alias=True, exclude_unset=True)


R = TypeVar("R", bound=BaseModel)


def parse_record(model: type[R], data: object, where: str, error: type[Exception] = DataError) -> R:
    """`data` (read from `where`: a file, or a message) as a `model`; `error` otherwise, one line per problem,
    each naming `where` and the key (fedccrl_core/foundation/hparams.py `problems`)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error("\n".join(problems(e, data, model, file=where))) from None
