"""pytest plugin: ``--without-fixture NAME`` deselects every test whose fixture closure holds NAME.

tools/check_alone.sh runs tidal-rollout's fast tests alone with ``-p pytest_without_fixtures --without-fixture
_sglang_engine --without-fixture lora_server`` (this folder on ``PYTHONPATH``): the tests that need one of the test
session's SGLang servers are left to the workspace run, so that the package-alone step brings up no server beyond its
README example's. The deselected count is printed by pytest
as usual ("N deselected"), and a name that no collected test uses is an error, so a renamed fixture cannot turn the
filter into a silent no-op.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--without-fixture``."""
    parser.addoption(
        "--without-fixture",
        action="append",
        default=[],
        metavar="NAME",
        help="deselect the tests that use fixture NAME, directly or through other fixtures (repeatable)",
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the items whose fixture closure names a ``--without-fixture`` fixture."""
    names = set(config.getoption("without_fixture"))
    if not names:
        return
    keep, drop, used = [], [], set()
    for item in items:
        hit = names.intersection(getattr(item, "fixturenames", ()))
        used |= hit
        (drop if hit else keep).append(item)
    unused = sorted(names - used)
    if unused and items:
        raise pytest.UsageError(f"--without-fixture {', '.join(unused)}: no collected test uses it; fix the name")
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
