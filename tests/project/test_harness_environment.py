"""The harness's own rule (tests/conftest.py): a test that leaves os.environ changed fails, naming the
variables; the variables a library's first import sets pass only when that import happened in the test."""
from __future__ import annotations

from pathlib import Path

pytest_plugins = ("pytester",)

CONFTEST = (Path(__file__).resolve().parents[1] / "conftest.py").read_text()


def test_a_test_that_leaves_a_variable_set_fails_naming_it(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner="""
import os

def test_sets():
    os.environ["CHANGEFORGE_HARNESS_PROBE"] = "1"

def test_library_variable_without_the_import():
    os.environ["LD_LIBRARY_PATH"] = "/elsewhere"     # cv2, ray, rasterio and sklearn are imported already

def test_clean(monkeypatch):
    monkeypatch.setenv("CHANGEFORGE_HARNESS_PROBE", "2")
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_sets*",
                                 "the test left os.environ changed: ['CHANGEFORGE_HARNESS_PROBE']",
                                 "*ERROR at teardown of test_library_variable_without_the_import*",
                                 "the test left os.environ changed: ['LD_LIBRARY_PATH']"])
