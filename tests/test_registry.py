"""The pass registry is complete by construction: a broken pass package fails at import, clearly."""
from __future__ import annotations

import sys
import textwrap

import pytest

from fxfuse import registry
from fxfuse.errors import PassRegistrationError


def _make_pkg(tmp_path, name, modules):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for mod, src in modules.items():
        (pkg / f"{mod}.py").write_text(textwrap.dedent(src))
    sys.path.insert(0, str(tmp_path))
    return name


GOOD = """
from fxfuse.registry import register_pass
@register_pass(name="{name}", order=1, description="test")
def run(gm, ctx):
    return 0
"""


@pytest.fixture(autouse=True)
def _restore_registry():
    saved = dict(registry._REGISTRY), dict(registry._MODULE_OF_PASS)
    yield
    registry._REGISTRY.clear(); registry._REGISTRY.update(saved[0])
    registry._MODULE_OF_PASS.clear(); registry._MODULE_OF_PASS.update(saved[1])
    sys.path[:] = [p for p in sys.path if "pytest" not in p or "registry" not in p]


def test_builtin_passes_are_registered_at_import():
    import fxfuse.passes as p

    names = [s.name for s in p.PASSES]
    assert names == [s.name for s in registry.registered_passes() if s.module.startswith("fxfuse.passes")]
    assert len(names) == len(set(names))


def test_module_that_fails_to_import(tmp_path):
    pkg = _make_pkg(tmp_path, "pkg_import_error", {"ok": GOOD.format(name="ok_a"), "broken": "import no_such_mod\n"})
    with pytest.raises(PassRegistrationError, match=r"pkg_import_error\.broken failed to import.*no_such_mod"):
        registry.load_pass_package(pkg)


def test_module_that_registers_nothing(tmp_path):
    pkg = _make_pkg(tmp_path, "pkg_no_register", {"empty": "def run(gm, ctx):\n    return 0\n"})
    with pytest.raises(PassRegistrationError, match=r"pkg_no_register\.empty imported but registered no pass"):
        registry.load_pass_package(pkg)


def test_two_passes_with_one_name(tmp_path):
    pkg = _make_pkg(tmp_path, "pkg_dup", {"a": GOOD.format(name="same"), "b": GOOD.format(name="same")})
    with pytest.raises(PassRegistrationError, match=r"two passes are named 'same'"):
        registry.load_pass_package(pkg)


def test_unknown_pass_lookup_lists_known_names():
    with pytest.raises(PassRegistrationError, match="known passes"):
        registry.get_pass("definitely_not_a_pass")


UNORDERED = """
from fxfuse.registry import register_pass
@register_pass(name="{name}", description="test")
def run(gm, ctx):
    return 0
"""


def test_builtin_passes_run_in_the_packages_explicit_order():
    import fxfuse.passes as p

    assert [s.name for s in p.PASSES] == list(p.PASS_ORDER)
    assert [s.name for s in registry.registered_passes() if s.builtin and s.module.startswith("fxfuse.passes")] \
        == list(p.PASS_ORDER)


def test_order_list_must_name_every_pass_once(tmp_path):
    pkg = _make_pkg(tmp_path, "pkg_order", {"a": UNORDERED.format(name="ord_a"), "b": UNORDERED.format(name="ord_b")})
    with pytest.raises(PassRegistrationError, match=r"not in the order: \['ord_b'\].*not registered: \['ord_c'\]"):
        registry.load_pass_package(pkg, order=["ord_a", "ord_c"])


def test_order_list_sets_the_order(tmp_path):
    pkg = _make_pkg(tmp_path, "pkg_order_ok", {"a": UNORDERED.format(name="ok_1"), "b": UNORDERED.format(name="ok_2")})
    assert [s.name for s in registry.load_pass_package(pkg, order=["ok_2", "ok_1"])] == ["ok_2", "ok_1"]


def test_pass_without_any_order(tmp_path):
    pkg = _make_pkg(tmp_path, "pkg_no_order", {"a": UNORDERED.format(name="lost")})
    with pytest.raises(PassRegistrationError, match=r"\['lost'\].*have no order"):
        registry.load_pass_package(pkg)
