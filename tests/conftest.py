"""Test-session settings shared by every tier.

The rule database of the whole session lives in a temporary folder
(``METADIST_CACHE_DIR``, inherited by the processes tests launch), so tests
never read or write the user's cache, and rules discovered by one test are
reused by the next as they would be in real use. CPU runs that name no cluster plan on the
``cpu-gloo`` preset (``METADIST_CPU_CLUSTER``), not on this machine's calibration, so that the
plans tests check do not depend on the machine (tests of the calibration set their own).
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def isolated_rule_cache(tmp_path_factory: pytest.TempPathFactory):
    settings = {"METADIST_CACHE_DIR": str(tmp_path_factory.mktemp("metadist-cache")), "METADIST_CPU_CLUSTER": "cpu-gloo"}
    previous = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    yield
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def jax_rules_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A rule database of JAX entries only, shared by the tests that discover JAX rules: GPT-2's ops, discovered by
    the first of them (a minute and more on 2 cores), are read back by the next instead of discovered again."""
    return str(tmp_path_factory.mktemp("jax-rules") / "rules.sqlite")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--zoo", action="store_true", default=False,
                     help="also run the whole model zoo under --check (tests marked zoo; about an hour on 2 CPUs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Zoo tests run only with --zoo; GPU tests skip cleanly without a CUDA device."""
    if not config.getoption("--zoo"):
        skip_zoo = pytest.mark.skip(reason="the whole model zoo runs with --zoo (pytest --zoo tests/test_zoo.py)")
        for item in items:
            if item.get_closest_marker("zoo") is not None:
                item.add_marker(skip_zoo)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
