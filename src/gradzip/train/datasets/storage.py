"""Dataset files: where they are looked for, downloading them (MD5-checked against the
well-known sums), verifying a ``SHA256SUMS`` file beside them, and reading them (gunzipped
when gzip data). Every failure is one :class:`GradzipError` naming the file and the fix.
"""
from __future__ import annotations

import gzip
import hashlib
import logging
import os
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from ...errors import GradzipError

log = logging.getLogger(__name__)


# Download mirrors (tried in order) and the well-known MD5 checksums of the gzipped files.
MIRRORS = {
    "mnist": [
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "http://yann.lecun.com/exdb/mnist/",
    ],
    "fashion-mnist": [
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    ],
    "cifar10": ["https://www.cs.toronto.edu/~kriz/"],
}
MD5 = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
    "cifar10": {"cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a"},
}


def require_dir(name: str, data_dir, download: bool) -> Path:
    """``data_dir`` as a path, checked: given, a directory (or creatable when downloading)."""
    if data_dir is None or (isinstance(data_dir, str) and not data_dir.strip()):
        raise GradzipError(f"dataset {name!r} is read from files: pass a data directory "
                           f"(data_dir=..., or --data-dir on the command line), or use "
                           f"'digits' or 'synthetic', which need none.")
    root = Path(data_dir).expanduser()
    if root.exists() and not root.is_dir():
        raise GradzipError(f"data directory {str(root)!r} is not a directory; pass the "
                           f"directory that holds (or should receive) the {name} files.")
    if not root.exists() and not download:
        raise GradzipError(f"data directory {str(root)!r} does not exist; create it with the "
                           f"{name} files in it, or allow downloading.")
    return root


def hash_file(path: Path, algo: str) -> str:
    """The hex digest of a file's content by ``algo`` (``"md5"``, ``"sha256"``)."""
    h = hashlib.new(algo, usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256sums(directory: Path, files) -> None:
    """Check ``files`` (paths inside ``directory``) against ``directory/SHA256SUMS``.

    Files the list does not mention are not checked; a listed file whose hash differs, or
    a malformed line, is an error.
    """
    sums_path = directory / "SHA256SUMS"
    if not sums_path.is_file():
        return
    expected = {}
    for lineno, line in enumerate(sums_path.read_text(errors="replace").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        digest = parts[0].lower()
        if (len(parts) != 2 or len(digest) != 64
                or any(ch not in "0123456789abcdef" for ch in digest)):
            raise GradzipError(f"{sums_path} line {lineno} is not '<sha256>  <file name>'; "
                               f"fix or remove the SHA256SUMS file.")
        expected[parts[1].strip().lstrip("*").removeprefix("./")] = digest
    for path in files:
        rel = Path(path).relative_to(directory).as_posix()
        if rel in expected:
            actual = hash_file(Path(path), "sha256")
            if actual != expected[rel]:
                raise GradzipError(f"{path} does not match its checksum in {sums_path} "
                                   f"(sha256 {actual}, expected {expected[rel]}); the file is "
                                   f"corrupt or was changed: download it again or fix "
                                   f"SHA256SUMS.")


def download(urls: list[str], dest: Path, md5: str | None) -> None:
    """Fetch ``dest`` from the first of ``urls`` that answers with the right MD5.

    Writes a temporary file of this process and renames it into place on success, so
    ranks that download at once never read a partial file. Raises ``OSError`` (network
    failure: the caller reports the missing files) or :class:`GradzipError` (every answer
    had the wrong checksum).
    """
    errors, bad_checksum = [], []
    for url in urls:
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.part")  # one per process
        try:
            log.info("downloading %s to %s", url, dest)
            digest = hashlib.md5(usedforsecurity=False)
            with urllib.request.urlopen(url, timeout=60) as resp:
                dest.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as out:
                    for chunk in iter(lambda: resp.read(1 << 20), b""):
                        digest.update(chunk)
                        out.write(chunk)
            if md5 is not None and digest.hexdigest() != md5:
                bad_checksum.append(f"{url} (md5 {digest.hexdigest()}, expected {md5})")
                tmp.unlink(missing_ok=True)
                continue
            os.replace(tmp, dest)
            return
        except (OSError, urllib.error.URLError, ValueError) as exc:  # HTTPError is a URLError
            tmp.unlink(missing_ok=True)
            errors.append(f"{url}: {exc}")
    if bad_checksum:
        raise GradzipError(f"downloaded {dest.name} has the wrong checksum from "
                           f"{'; '.join(bad_checksum)}; the mirror or the connection "
                           f"corrupted it: retry, or place a good copy at {dest}.")
    raise OSError("; ".join(errors))


def one_line(exc: BaseException) -> str:
    """An exception's text on one line (some, e.g. pickle's, span several)."""
    return " ".join(str(exc).split())


def not_found(name: str, where: list[Path], files: list[str], reason: str) -> GradzipError:
    """The error for a dataset whose files are missing and could not be downloaded."""
    dirs = " or ".join(str(d) for d in dict.fromkeys(where))
    return GradzipError(f"{name} files were not found in {dirs} and could not be downloaded "
                        f"({' '.join(reason.split())}); place these files there: {', '.join(files)}.")


def read_bytes(path: Path) -> bytes:
    """A file's content, gunzipped when it is gzip data; corrupt gzip names the file."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise GradzipError(f"cannot read {path} ({exc.strerror or one_line(exc)}); check the file and "
                           f"its permissions.") from None
    if raw[:2] != b"\x1f\x8b":
        if path.suffix == ".gz":
            raise GradzipError(f"{path} is not a gzip file (bad header); delete it and "
                               f"download it again.")
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise GradzipError(f"{path} is a corrupt or truncated gzip file ({one_line(exc)}); delete it "
                           f"and download it again.") from None

