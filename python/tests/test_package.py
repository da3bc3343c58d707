"""The installed package: its public names, stubs and PTX."""

import ast
import pathlib

import carve
from carve import _carve

PKG = pathlib.Path(carve.__file__).parent


def test_public_names_exist():
    for name in carve.__all__:
        assert hasattr(carve, name), name
    assert issubclass(carve.OutOfMemoryError, carve.CarveError)
    assert issubclass(carve.OutOfMemoryError, MemoryError)


def test_stubs_cover_the_extension_module():
    stub = PKG / "_carve.pyi"
    tree = ast.parse(stub.read_text())
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stubbed |= {t.target.id for t in tree.body if isinstance(t, ast.AnnAssign)}
    public = {n for n in dir(_carve) if not n.startswith("_")}
    assert public == stubbed, (public ^ stubbed)
    assert (PKG / "py.typed").exists()


def test_ptx_path_holds_the_heap_functions():
    path = pathlib.Path(carve.ptx_path())
    text = path.read_text()
    for fn in (
        "carve_numba_slab_alloc",
        "carve_numba_slab_free",
        "carve_numba_bump_alloc",
        "carve_numba_bump_alloc_block",
        "carve_numba_malloc",
        "carve_numba_free",
    ):
        assert f"\n.visible .func  (.param .b32 func_retval0) {fn}(" in text, fn
    assert carve.ptx_path() == str(path)  # cached


def test_lib_path_is_the_extension_module():
    assert pathlib.Path(carve.lib_path()).exists()
    assert carve.lib_path().endswith((".so", ".pyd"))
