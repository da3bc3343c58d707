"""Files carve writes and loads (the PTX, the PyTorch shim) live in a per-user cache that is
checked before use: a folder or file another user could have planted is never used."""

import os
import pathlib
import shutil
import stat
import subprocess
import sys
import textwrap

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


# ---- carve.torch's out-of-memory shim, with a stand-in torch and compiler -------------------

FAKE_TORCH = {
    "torch/__init__.py": textwrap.dedent(
        """
        __version__ = "0.0.0+carve-test"
        class _C:
            _GLIBCXX_USE_CXX11_ABI = True
        """
    ),
    "torch/utils/__init__.py": "",
    "torch/utils/cpp_extension.py": "def include_paths():\n    return []\n"
    "def library_paths():\n    return []\n",
}

GOOD_SHIM = r"""
int carve_shim_init(const char* lib) { (void)lib; return 0; }
void* carve_torch_alloc_or_throw(long size, int device, void* stream) {
  (void)size; (void)device; (void)stream; return 0;
}
"""

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE* f = fopen(getenv("CARVE_TEST_MARKER"), "w");
  if (f) { fputs("planted code ran", f); fclose(f); }
}
int carve_shim_init(const char* lib) { (void)lib; return 0; }
void* carve_torch_alloc_or_throw(long size, int device, void* stream) {
  (void)size; (void)device; (void)stream; return 0;
}
"""

# Plants a library at the shim's cache name in each folder of argv[1:], then asks
# carve.torch for the shim.
CHILD = textwrap.dedent(
    """
    import hashlib, os, shutil, sys, warnings
    import carve.torch as ct
    key = hashlib.sha256(f"{ct._SHIM}{ct._torch.__version__}1".encode()).hexdigest()[:16]
    for folder in sys.argv[1:]:
        shutil.copy(os.environ["CARVE_TEST_PLANTED"], os.path.join(folder, f"torch_oom_shim_{key}.so"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        addr = ct._checked_alloc_address()
    print("ADDR", addr)
    print("LOADED", ct._shim._name if ct._shim is not None else None)
    for x in w:
        print("WARNING", x.message)
    """
)


def _cc(src, out, tmp_path):
    c = tmp_path / (out.name + ".c")
    c.write_text(src)
    subprocess.run(["cc", "-shared", "-fPIC", str(c), "-o", str(out)], check=True)


@pytest.fixture
def shim_env(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler to build the stand-in libraries")
    for rel, text in FAKE_TORCH.items():
        p = tmp_path / "fake" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    good, planted = tmp_path / "good.so", tmp_path / "planted.so"
    _cc(GOOD_SHIM, good, tmp_path)
    _cc(PLANTED, planted, tmp_path)
    cxx = tmp_path / "fake-cxx"
    # Stands in for the compiler: "builds" the shim by copying the good library to -o.
    cxx.write_text(
        '#!/bin/sh\nwhile [ "$#" -gt 0 ]; do\n'
        '  if [ "$1" = "-o" ]; then cp "$GOOD" "$2"; exit $?; fi\n  shift\ndone\nexit 1\n'
    )
    cxx.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CARVE_CACHE_DIR", "XDG_CACHE_HOME", "TMPDIR")
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp_path / "fake")] + sys.path),
        CXX=str(cxx),
        GOOD=str(good),
        HOME=str(home),
        CARVE_TEST_PLANTED=str(planted),
        CARVE_TEST_MARKER=str(tmp_path / "marker"),
    )
    return env


def _run_child(env, *plant_in):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, plant_in)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    return lines, proc.stdout


def _assert_not_loaded(env, planted_folder, out):
    marker = pathlib.Path(env["CARVE_TEST_MARKER"])
    assert not marker.exists(), f"a planted library was loaded:\n{out}"
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["ADDR"] != "None", out
    loaded = pathlib.Path(lines["LOADED"])
    assert loaded.parent != pathlib.Path(planted_folder), out
    assert loaded.read_bytes() == pathlib.Path(env["GOOD"]).read_bytes(), out


def test_torch_shim_ignores_a_library_planted_in_the_shared_temp_folder(shim_env, tmp_path):
    shared = tmp_path / "tmp"
    (shared / "carve").mkdir(parents=True)
    shared.chmod(0o1777)
    (shared / "carve").chmod(0o777)
    shim_env["TMPDIR"] = str(shared)
    _, out = _run_child(shim_env, shared / "carve")
    _assert_not_loaded(shim_env, shared / "carve", out)
    # It was built into the per-user cache, and the next process loads it from there.
    private = tmp_path / "home" / ".cache" / "carve"
    first, _ = _run_child(shim_env)
    assert pathlib.Path(first["LOADED"]).parent == private
    again, _ = _run_child(shim_env)
    assert again["LOADED"] == first["LOADED"]


def test_torch_shim_ignores_a_cache_dir_others_can_write(shim_env, tmp_path):
    shared = tmp_path / "open"
    shared.mkdir()
    shared.chmod(0o777)
    shim_env["CARVE_CACHE_DIR"] = str(shared)
    _, out = _run_child(shim_env, shared)
    _assert_not_loaded(shim_env, shared, out)
    assert "writable by others" in out


@pytest.mark.skipif(not IS_ROOT, reason="needs root to give a folder to another user")
def test_torch_shim_ignores_a_cache_dir_owned_by_another_user(shim_env, tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    shim_env["CARVE_CACHE_DIR"] = str(theirs)
    _, out = _run_child(shim_env, theirs)
    _assert_not_loaded(shim_env, theirs, out)


def test_torch_shim_rebuilds_a_library_whose_hash_is_not_recorded(shim_env, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    shim_env["CARVE_CACHE_DIR"] = str(mine)
    _, out = _run_child(shim_env, mine)
    assert not pathlib.Path(shim_env["CARVE_TEST_MARKER"]).exists(), out
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    loaded = pathlib.Path(lines["LOADED"])
    assert loaded.read_bytes() == pathlib.Path(shim_env["GOOD"]).read_bytes(), out
