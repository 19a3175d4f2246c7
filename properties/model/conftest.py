"""The model clauses run once per model under test (`mut`): the zoo's families, --model or --zoo."""
from __future__ import annotations

import pytest

from properties.model.subjects import model_under_test, subject_ids


def pytest_generate_tests(metafunc):
    if "mut" in metafunc.fixturenames:
        metafunc.parametrize("mut", subject_ids(metafunc.config), indirect=True)


@pytest.fixture(scope="session")
def mut(request):
    return model_under_test(request.config, request.param)
