"""The tiny model kvj serve's tests serve: made once per session, offline (``support.serve_model``)."""

from __future__ import annotations

import pytest

from support.serve_model import make_model


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(str(tmp_path_factory.mktemp("serve-model")))
