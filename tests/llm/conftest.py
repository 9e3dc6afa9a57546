"""Fixtures of the LLM layer's tests."""
import uuid

import pytest


@pytest.fixture()
def llm_namespace(monkeypatch):
    """A fresh Ray namespace for this test's account limiters (jobs and run_pool find them there), so
    limits a test sets never reach another test's pool."""
    from operators.llm.ratelimit import NAMESPACE_ENV
    namespace = f"changeforge-llm-test-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv(NAMESPACE_ENV, namespace)
    return namespace
