"""The harness's order on two or more workers (tests/conftest.py, ``pytest_xdist_make_scheduler``): the
modules on the session's Label Studio or the session's captions output are one unit, handed out second,
after the cluster, so one worker starts that server and runs that captions job for all of them."""
from __future__ import annotations

from tests.conftest import REPO, SESSION_LABEL_STUDIO, scope_weight, uses_session_label_studio


def modules() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py"))


def test_the_modules_on_the_session_s_label_studio_and_captions_output_are_one_unit():
    grouped = {m for m in modules() if uses_session_label_studio(m)}
    assert {"tests/jobs/test_chain_e2e.py", "tests/annotation/test_annotate_label_studio.py",
            "tests/review/test_review_label_studio.py", "tests/review/test_report.py"} <= grouped
    # a module that only imports operators.review.label_studio, and one that starts servers of its own
    assert not grouped & {"tests/review/test_review_cores.py", "tests/jobs/test_chain_two_instances.py"}


def test_the_cluster_then_that_unit_come_first():
    others = [scope_weight(m) for m in modules() if not m.startswith("tests/cluster/")
              and not uses_session_label_studio(m)]
    assert scope_weight("tests/cluster/") > scope_weight(SESSION_LABEL_STUDIO) > max(others)
