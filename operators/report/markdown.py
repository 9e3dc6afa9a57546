"""Result tables as Markdown (the report's tables.md and the review summary)."""
from __future__ import annotations

from operators.report.stats import Table


def markdown_table(t: Table) -> str:
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")
    lines = [f"### {t.title}", "", "| " + " | ".join(cell(c) for c in t.columns) + " |",
             "|" + "|".join("---" for _ in t.columns) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in t.rows]
    return "\n".join(lines) + "\n"


def review_result_tables(s: dict) -> list[Table]:
    """The review summary as tables: acceptance and agreement, then verdicts and errors by facet."""
    if not s or not s.get("tasks"):
        return []

    def rate(r: dict) -> str:
        if not r["n"]:
            return "— (no reviewed selected items)"
        lo, hi = r["wilson95"]
        return f"{100 * r['rate']:.1f}% ({r['accepted']}/{r['n']}; Wilson 95% {100 * lo:.1f}-{100 * hi:.1f}%)"

    ag = s["judge_agreement"]
    kappa = "undefined (human and judge gave every item one and the same label)" if ag["cohens_kappa"] is None else f"{ag['cohens_kappa']:.3f}"
    head = Table("review", "Human review", ["Measure", "Value"], [
        ["Tasks / reviewed / unreviewed", f"{s['tasks']} / {s['reviewed']} / {s['unreviewed']}"],
        ["Acceptance of selected items (correct)", rate(s["acceptance_strict"])],
        ["Acceptance of selected items (correct or partly)", rate(s["acceptance_lenient"])],
        ["Verdicts (correct / partly / wrong)", " / ".join(str(v) for v in s["verdicts"].values())],
        ["Human vs judge accept/reject: Cohen's kappa", f"{kappa} over {ag['n']} items"],
        ["Both accept / both reject / only human / only judge",
         f"{ag['both_accept']} / {ag['both_reject']} / {ag['human_only_accept']} / {ag['judge_only_accept']}"],
        ["Corrected by reviewers", str(len(s["corrections"]))],
    ])
    cats = list(next(iter(s["by_facet"].values()))["error_categories"]) if s["by_facet"] else []
    facets = Table("review_facets", "Verdicts and error categories by perspective / question type",
                   ["Facet", "Reviewed", "Correct", "Partly", "Wrong"] + cats,
                   [[f or "—", g["reviewed"], *g["verdicts"].values(), *[g["error_categories"][c] for c in cats]]
                    for f, g in s["by_facet"].items()])
    return [head, facets]


def review_tables(s: dict) -> str:
    parts = [markdown_table(t) for t in review_result_tables(s)]
    if s.get("corrections"):
        parts.append("### Corrected by reviewers\n")
        parts += [f"- `{c['item_id']}` ({c['facet']}, {c['verdict']}): {c['text']!r} -> {c['corrected_text']!r}"
                  for c in s["corrections"]]
    return "\n".join(parts) if parts else "no review tasks\n"
