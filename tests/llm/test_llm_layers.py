"""The LLM layer's place in the import graph (issue 46, item 7): ``operators/llm`` imports nothing from
the language layer above it (the validators' tally is the language layer's own), the runner's modules
(options, passes, summaries, set-up) import no cycle, and the LLM jobs are wiring that imports no other
job. Read from the source with :mod:`ast` (lazy imports count), as tests/project/test_import_graph.py."""
from __future__ import annotations

import pytest

from tests.project.test_import_graph import ROOT, find_cycle, imported_names, module_name, repo_graph

LLM_JOBS = ("caption", "qa", "score", "validate")
RUNNER = ("job_options", "job_passes", "job_summary", "job_runner")


def test_the_llm_layer_imports_nothing_from_the_language_layer():
    graph, _ = repo_graph()   # parsed once for the suite (read only)
    llm = {m: deps for m, deps in graph.items() if m.startswith("operators.llm.")}
    assert len(llm) >= 10
    upward = sorted((m, d) for m, deps in llm.items() for d in deps if d.startswith("operators.language"))
    assert not upward, f"operators/llm imports the language layer: {upward}"


def test_the_runner_is_split_into_modules_without_a_cycle():
    graph, _ = repo_graph()   # parsed once for the suite (read only)
    runner = {f"operators.llm.{m}" for m in RUNNER}
    assert runner <= set(graph)
    sub = {m: graph[m] & runner for m in runner}
    assert find_cycle(sub) is None
    # Options know nothing of the passes or the summaries; the passes nothing of the set-up.
    assert not sub["operators.llm.job_options"]
    assert "operators.llm.job_runner" not in sub["operators.llm.job_passes"]
    assert not sub["operators.llm.job_summary"]


@pytest.mark.parametrize("job", LLM_JOBS)
def test_an_llm_job_imports_no_other_job(job):
    path = ROOT / "jobs" / f"{job}.py"
    names = imported_names(path, module_name(path, ROOT))
    others = sorted(n for n in names if n == "jobs" or (n.startswith("jobs.") and n != f"jobs.{job}"))
    assert not others, f"jobs/{job}.py imports {others}"


def test_the_validators_tally_counts_every_rule_and_the_rejected():
    from operators.language.validators import RULES, validator_tally
    rows = [{"validator_ok": False, "validator_violations": '[{"rule": "numbers", "detail": "20%"},'
                                                             ' {"rule": "numbers", "detail": "3 px"}]'},
            {"validator_ok": False, "validator_violations": '[{"rule": "location", "detail": "x"}]'},
            {"validator_ok": True, "validator_violations": ""}]
    tally = validator_tally(rows, "reject")
    assert list(tally["validator_caught"]) == list(RULES)
    assert tally["validator_caught"]["numbers"] == 1 and tally["validator_caught"]["location"] == 1
    assert sum(tally["validator_caught"].values()) == 2 and tally["validator_rejected"] == 2
    assert validator_tally(rows, "flag")["validator_rejected"] == 0
