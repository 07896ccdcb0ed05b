import os
import sys

from tidal.rollout.bytecode import compile_site_packages, site_packages_of
from tidal.rollout.engine import missing_bytecode_note

PROBE = "tidal_bytecode_probe_once"


def _probe_site(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    (site / PROBE).mkdir(parents=True)
    (site / PROBE / "__init__.py").write_text("VALUE = 1\n")
    (site / PROBE / "part.py").write_text("def f():\n    return 2\n")
    (site / "neighbour.py").write_text("X = 3\n")  # the whole folder is compiled, not only the package
    monkeypatch.syspath_prepend(str(site))
    return site


def test_compiles_the_folder_once_so_that_servers_stop_compiling_from_source(tmp_path, monkeypatch):
    site = _probe_site(tmp_path, monkeypatch)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"} | {"PYTHONDONTWRITEBYTECODE": "1"}
    assert site_packages_of(PROBE) == site
    assert missing_bytecode_note(env, PROBE) is not None
    seconds = compile_site_packages(env, package=PROBE)
    assert seconds is not None and seconds > 0
    tag = sys.implementation.cache_tag
    for pyc in (f"{PROBE}/__pycache__/__init__.{tag}.pyc", f"{PROBE}/__pycache__/part.{tag}.pyc",
                f"__pycache__/neighbour.{tag}.pyc"):  # fmt: skip
        assert (site / pyc).is_file(), pyc
    assert missing_bytecode_note(env, PROBE) is None


def test_compiles_where_the_server_env_looks_for_bytecode(tmp_path, monkeypatch):
    site = _probe_site(tmp_path, monkeypatch)
    prefix = tmp_path / "pycache"
    env = dict(os.environ) | {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(prefix)}
    assert compile_site_packages(env, package=PROBE) is not None
    assert not (site / PROBE / "__pycache__").exists()
    assert missing_bytecode_note(env, PROBE) is None  # found under the prefix, where Python will look


def test_a_package_that_is_not_installed_is_left_alone():
    assert compile_site_packages(dict(os.environ), package="tidal_no_such_package") is None
