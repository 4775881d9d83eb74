"""HTTP(S) download: stream a URL to a file, with retries, progress and an optional sha256 check.

Time limits. `timeout_s` (params `download.timeout_s`) bounds the connection and each wait for bytes;
`deadline_s` (params `download.deadline_s`) bounds the whole download of one archive, every retry and
backoff included, so a server that trickles a byte now and then cannot hold the stage for ever. The
body is read with `read1` (whatever bytes have arrived, never "wait for 1 MB"), so the deadline is
checked as the bytes come in; it is passed by at most `timeout_s`. A download past its deadline is a
DataError naming the URL and is not retried.

Retries. Connection errors, timeouts, HTTP 5xx/408/429 and a body shorter than its Content-Length
(a connection dropped midway) are retried `download.retries` times with exponential backoff
(1 s, 2 s, 4 s ...); HTTP 4xx, an HTML page instead of an archive (Google Drive's warning page)
and a checksum mismatch are not.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from fedccrl_core.data.checksums import CHUNK, fmt_mb
from fedccrl_core.foundation.errors import ChecksumError, DataError
from fedccrl_core.foundation.progress import progress as counter

USER_AGENT = "fedccrl-download/0.1 (+https://github.com/; python urllib)"
DEADLINE_S = 3600.0  # the whole download of one archive when the caller gives none (params: download.deadline_s)


class _Retryable(Exception):
    """A transient failure: connection refused/reset/dropped, timeout, HTTP 5xx/408/429."""


class _Deadline:
    """The end of the whole download (time.monotonic), and the error that names it."""

    def __init__(self, url: str, deadline_s: float | None):
        self.url, self.deadline_s = url, deadline_s
        self.end = time.monotonic() + deadline_s if deadline_s else None

    def left(self) -> float:
        return self.end - time.monotonic() if self.end is not None else float("inf")

    def check(self, got: int | None = None, expected: int | None = None) -> None:
        if self.left() <= 0:
            of = f" of {fmt_mb(expected)}" if expected else ""
            at = f"{fmt_mb(got)}{of} received; " if got is not None else ""
            raise DataError(
                f"{self.url}: the download did not finish within download.deadline_s={self.deadline_s:g} s "
                f"({at}the server sends too slowly or keeps failing). Raise download.deadline_s, "
                f"or download the file by hand and set dataset.source to its path"
            )


def _download_once(url: str, dest: Path, timeout_s: float, progress: bool, label: str, deadline: _Deadline) -> str:
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    try:
        resp = urllib.request.urlopen(req, timeout=max(0.1, min(timeout_s, deadline.left())))
    except urllib.error.HTTPError as e:
        e.close()
        if e.code >= 500 or e.code in (408, 429):
            raise _Retryable(f"HTTP {e.code} {e.reason}") from e
        raise DataError(f"{url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, OSError) as e:
        reason = getattr(e, "reason", e)
        raise _Retryable(f"cannot connect ({reason})") from e
    h = hashlib.sha256()
    got = 0
    with resp:
        ctype = (resp.headers.get("Content-Type") or "").lower()
        if ctype.startswith("text/html"):
            raise DataError(
                f"{url}: the server sent an HTML page, not an archive (a sign-in, quota or "
                f"confirmation page?); download the file by hand and set dataset.source to its path"
            )
        length = resp.headers.get("Content-Length")
        expected = int(length) if length and length.isdigit() else None
        with open(dest, "wb") as f, counter(expected, f"download {label}", progress, nbytes=True) as bar:
            while True:
                deadline.check(got, expected)
                try:
                    chunk = resp.read1(CHUNK)  # the bytes that have arrived: never blocks until CHUNK are in
                except (TimeoutError, ConnectionError, http.client.HTTPException, OSError) as e:
                    deadline.check(got, expected)
                    raise _Retryable(f"connection lost after {got} bytes ({e.__class__.__name__}: {e})") from e
                if not chunk:
                    break
                f.write(chunk)
                h.update(chunk)
                got += len(chunk)
                bar.update(len(chunk))
    if expected is not None and got != expected:
        raise _Retryable(f"connection dropped: received {got} of {expected} bytes (Content-Length)")
    if got == 0:
        raise DataError(f"{url}: the server sent an empty response")
    return h.hexdigest()


def download_url(
    url: str,
    dest: str | os.PathLike,
    sha256: str | None = None,
    timeout_s: float = 60,
    retries: int = 3,
    backoff_s: float = 1.0,
    progress: bool = True,
    label: str | None = None,
    deadline_s: float | None = DEADLINE_S,
) -> str:
    """Stream `url` to `dest` (retries with exponential backoff); return the file's sha256.

    A Content-Length that is not met (a connection dropped midway) is an error, never a short
    file. When `sha256` is given it is compared after the download (ChecksumError on mismatch).
    The whole download, retries included, must finish within `deadline_s` (None: no limit).
    On failure `dest` is removed.
    """
    dest = Path(dest)
    label = label or dest.name
    want = sha256 or None  # lower-case hex: params.yaml's schema (dataset.sha256) or the registry's
    deadline = _Deadline(url, deadline_s)
    attempt = 0
    try:
        while True:
            try:
                digest = _download_once(url, dest, timeout_s, progress, label, deadline)
                break
            except _Retryable as e:
                deadline.check()
                if attempt >= retries:
                    raise DataError(f"{url}: download failed after {attempt + 1} attempt(s): {e}") from e
                wait = min(backoff_s * (2**attempt), max(0.0, deadline.left()))
                print(
                    f"download {label}: {e}; retrying in {wait:.1f}s ({attempt + 1}/{retries})",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(wait)
                attempt += 1
        if want and digest != want:
            raise ChecksumError(
                f"{url}: sha256 mismatch for {label}: expected {want}, got {digest} "
                f"(dataset.sha256); nothing was extracted"
            )
        return digest
    except BaseException:
        with contextlib.suppress(OSError):
            dest.unlink()
        raise
