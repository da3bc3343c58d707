"""Files carve writes and loads (the PTX for Numba) live in a per-user cache that is
checked before use: a folder or file another user could have planted is never used."""

import os
import pathlib
import stat

import pytest

import carve

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
NOBODY = 65534


def _private_env(monkeypatch, tmp_path):
    monkeypatch.delenv("CARVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_ptx_path_is_in_a_private_per_user_cache(monkeypatch, tmp_path):
    _private_env(monkeypatch, tmp_path)
    path = pathlib.Path(carve.ptx_path())
    assert path.parent == tmp_path / "xdg" / "carve"
    st = path.parent.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0


def test_ptx_path_refuses_a_cache_dir_others_can_write(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("CARVE_CACHE_DIR", str(shared))
    with pytest.raises(carve.CarveIOError, match="writable by others"):
        carve.ptx_path()
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give a folder to another user")
def test_ptx_path_refuses_a_cache_dir_owned_by_another_user(monkeypatch, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    monkeypatch.setenv("CARVE_CACHE_DIR", str(theirs))
    with pytest.raises(carve.CarveIOError, match="owned by"):
        carve.ptx_path()


def test_ptx_path_rewrites_a_planted_or_open_file(monkeypatch, tmp_path):
    _private_env(monkeypatch, tmp_path)
    path = pathlib.Path(carve.ptx_path())
    good = path.read_text()
    path.write_text("// planted\n")
    assert pathlib.Path(carve.ptx_path()).read_text() == good
    path.chmod(0o666)  # right content, but anyone could change it after the check
    assert carve.ptx_path() == str(path)
    assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0


def test_ptx_path_writes_through_no_predictable_temp_name(monkeypatch, tmp_path):
    """A symlink planted at a predictable temporary name must not redirect the write."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("CARVE_CACHE_DIR", str(cache))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (cache / f".carve-{os.getpid()}.ptx.tmp").symlink_to(victim)
    carve.ptx_path()
    assert victim.read_text() == "precious"
