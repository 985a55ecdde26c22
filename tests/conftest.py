"""Fixtures shared by the test files: offline stand-ins of the hub models (hub_standins.py).

A test that launches `vgrpo.py --model sd3` (or flux, or a CLIP-based reward) as a subprocess passes
HF_HUB_CACHE=hub_cache and HF_HUB_OFFLINE=1 in its environment; an in-process test asks for `use_hub_cache`.
Imports stay inside the fixtures: the test files set HF_HUB_OFFLINE before huggingface_hub is first imported.
"""

import pytest


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache directory (str) holding every stand-in with seed 0, built once per session (~5 s, 13 MB)."""
    from tests import hub_standins

    return hub_standins.build_hub_cache(str(tmp_path_factory.mktemp("hub_seed0")), seed=0)


@pytest.fixture(scope="session")
def hub_cache_other_seed(tmp_path_factory):
    """The same stand-ins built with seed 1 (other weights, same architectures); built only if a test asks."""
    from tests import hub_standins

    return hub_standins.build_hub_cache(str(tmp_path_factory.mktemp("hub_seed1")), seed=1)


@pytest.fixture
def use_hub_cache(monkeypatch, hub_cache):
    """Loads in this process resolve from hub_cache, offline. huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE
    once, when it is imported, so the environment variables alone would not reach a library already imported:
    its constants are patched too (both restored after the test)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", hub_cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache
