"""The default model, loaded once for the whole run: the modules that only read it (float32
weights, no compile) share it instead of each holding a copy of its own."""
import pytest

from lifeline.model.loader import load_model


@pytest.fixture(scope="session")
def default_model():
    return load_model()
