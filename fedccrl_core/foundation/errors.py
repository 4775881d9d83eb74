"""Errors with messages that name the file or field at fault.

Floor 0 of fedccrl_core (docs/architecture.md, "Layers")."""


class FedCCRLError(Exception):
    """Base class: str(err) is one line a user can act on."""


class DataError(FedCCRLError):
    """Dataset content or layout does not match what is expected (names the file / domain / class)."""


class ChecksumError(DataError):
    """A downloaded or local archive's sha256 differs from the expected one."""


class UnsafeArchiveError(DataError):
    """An archive member would land outside the target (zip-slip, absolute path, symlink escape)."""


class ParamError(FedCCRLError, ValueError):
    """Bad parameters (params.yaml, a stage option): one line per problem, each naming the key, the value and
    what is allowed (fedccrl_core/foundation/hparams.py `problems`)."""

    def __init__(self, *lines: str):
        super().__init__("\n".join(lines))
        self.lines = list(lines)


class UntrustedFileError(FedCCRLError):
    """A model file or checkpoint holds pickled objects other than tensors and plain data (a pickle can run
    code when loaded); it was refused, nothing in it ran (names the file and what it holds)."""
