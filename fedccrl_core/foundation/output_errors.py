"""`OutputError`: an output that could not be written, named as the user gave it, never by its temporary name
(floor 0, docs/architecture.md). An OSError while writing becomes one (no traceback), e.g.
`results/x.json: cannot write (No space left on device)`.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from fedccrl_core.foundation.errors import FedCCRLError

# errors of the body of a write that are about the output, not about something the body reads
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


class OutputError(FedCCRLError, OSError):
    """An output could not be written (unwritable folder, full disk, read-only file system)."""


def output_error(path: Path, e: OSError) -> OutputError:
    """`<output>: cannot write (<reason>)`, naming the path the OS complained about when it is another
    one (a parent that is a file, say), never the temporary name."""
    reason = e.strerror or str(e) or e.__class__.__name__
    other = Path(os.fsdecode(e.filename)) if e.filename else None
    if other is not None and other != path and not other.name.startswith(f".{path.name}."):
        reason += f": {other}"
    return OutputError(f"{path}: cannot write ({reason})")


@contextlib.contextmanager
def as_output_error(path: Path, any_errno: bool = True) -> Iterator[None]:
    """OSError in the block -> OutputError naming `path`: any OSError, or (any_errno=False: the body of a write,
    which may fail reading something else) only those about the output (a full disk, a read-only file system)."""
    try:
        yield
    except OutputError:
        raise
    except OSError as e:
        if any_errno or e.errno in _OUTPUT_ERRNOS:
            raise output_error(path, e) from e
        raise
