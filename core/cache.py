"""Where ggrun keeps what it downloads or builds once per machine (models, compiled kernels), and what it
derives from one model file to save the next run the work (repacked weights, a parsed GGUF header)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """ggrun's cache: $GGRUN_CACHE, else ~/.cache/ggrun."""
    env = os.environ.get("GGRUN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ggrun"


def file_identity(path: str | os.PathLike[str]) -> dict | None:
    """What says a file is still the one something was derived from: its real path, size, modification
    time and inode (None when the file cannot be looked at)."""
    try:
        real = Path(path).resolve()
        st = real.stat()
    except OSError:
        return None
    return {"model": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def derived_path(kind: str, identity: dict, suffix: str) -> Path:
    """The one cache file of `kind` for a file: named after its path, so that a changed file's replaces it."""
    real = Path(identity["model"])
    return cache_dir() / kind / f"{real.stem[:64]}-{hashlib.sha256(str(real).encode()).hexdigest()[:12]}{suffix}"


def write_atomically(path: Path, write) -> None:
    """Call write(file) on a temporary file beside `path`, then rename it to `path` (readers see the old
    file or the whole new one); OSError when it cannot be written, and nothing is left behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
