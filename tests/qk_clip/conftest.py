"""Shared by the QK-clip tests that install clips."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_leftover_clips():
    """After the test, no QKClip is left installed (each test calls ``remove()``). Use with
    ``pytestmark = pytest.mark.usefixtures("no_leftover_clips")``."""
    yield
    from shardmuon.qk_clip import recording

    assert not recording._INSTALLED, "a test left a QKClip installed (call remove())"
