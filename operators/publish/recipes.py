"""What the card and Croissant say about how a release was made, read from the runs that made it: the
recipes and their deviations from the papers, how the annotations were made (models, prompt versions,
judge threshold, validators, human review), and the known limitations.
"""
from __future__ import annotations

import json

from operators.publish.sources import DatasetSource, LanguageSource

# The papers' settings the pairs job's runs are compared with (S2Looking section 2.1).
PAPER_PAIRS = {"slice_size": 3000, "stride": 1024, "crop_size": 1024, "min_iou": 0.7, "min_gap_days": 365,
               "lookback_years": 10.0, "method": "per-slice"}
SELECTION = {"Captions": "overall judge score >= 7 of 10, at most the top 3 per pair (ties at the cut kept)",
             "QA": "overall judge score >= 7 of 10 (every passing QA pair kept)"}


def description(name: str, counts: dict, captions: bool, qa: bool, kind: str) -> str:
    parts = ["change masks"] + (["change captions"] if captions else []) + (["question-answer pairs"] if qa else [])
    src = "registered bitemporal satellite slices (S2Looking recipe)" if kind == "pairs_job" else \
        "bitemporal image pairs in the LEVIR-CD layout"
    return (f"{name}: {sum(counts.values())} {src} with " + ", ".join(parts) + "; splits "
            + ", ".join(f"{k} {v}" for k, v in counts.items()) + ".")


def _config(run: dict) -> dict:
    try:
        return json.loads(run.get("config") or "{}")
    except json.JSONDecodeError:
        return {}


def recipe_lines(dataset: DatasetSource, caps: LanguageSource | None, qa: LanguageSource | None) -> list[str]:
    lines = []
    if dataset.kind == "pairs_job":
        for run in dataset.runs:
            cfg = _config(run)
            job, pairing, reg = cfg.get("job", {}), cfg.get("pairing", {}), cfg.get("registration", {})
            used = {"slice_size": job.get("slice_size"), "stride": job.get("stride"), "crop_size": reg.get("crop_size"),
                    "min_iou": pairing.get("min_iou"), "min_gap_days": pairing.get("min_gap_days"),
                    "lookback_years": pairing.get("lookback_years"), "method": run.get("method")}
            dev = [f"{k} {v} (paper {PAPER_PAIRS[k]})" for k, v in used.items() if v is not None and v != PAPER_PAIRS[k]]
            did = _did(run.get("summary"))
            lines.append(f"Pairs: S2Looking recipe, changeforge `jobs.build_pairs` run {run['run_id']}{did} on "
                         f"`{run.get('input')}` (reference date {run.get('reference_date')}, split seed "
                         f"{run.get('seed')}, fractions {run.get('split_fractions')} by location); "
                         + ("deviations: " + "; ".join(dev) if dev else "paper settings") + ".")
    else:
        lines.append(f"Pairs: read from the LEVIR-CD layout at `{dataset.uri}`; masks as given, re-encoded 0/255.")
    for what, src in (("Captions", caps), ("QA", qa)):
        if src is None:
            continue
        if not src.runs:
            lines.append(f"{what}: read from `{src.uri}`, a {'LEVIR-CC' if what == 'Captions' else 'VQA'} JSON file "
                         "(the format names no model or prompt).")
        for run in src.runs:
            lines.append(f"{what}: JL1-CC&QA recipe (LLM generation, LLM judge), run {run['run_id']}: "
                         + ", ".join(f"{k} {v}" for k, v in run.items() if k != "run_id") + f"; selection: {SELECTION[what]}.")
    return lines


def _did(summary) -> str:
    try:
        s = json.loads(summary or "{}")
    except (TypeError, json.JSONDecodeError):
        return ""
    parts = [f"{s[k]} {what}" for k, what in (("slices_this_run", "slice(s) registered"),
                                             ("labels_merged_this_run", "label map(s) merged")) if s.get(k)]
    return f" ({', '.join(parts)})" if parts else ""


def review_summary(uri: str, caps: LanguageSource | None = None, qa: LanguageSource | None = None) -> dict | None:
    """The review's summary; with the language sources released, ``reviewed_on_other_text``: the reviewed
    items whose text was redone since they were reviewed. Their verdicts describe earlier text, so they
    are left out of every figure (acceptance, agreement, verdicts, corrections): they count as sampled
    tasks, unreviewed since redone (docs/lineage.md)."""
    from operators.io.storage import Store
    from operators.review.items import review_items, reviewed_on_other_text, set_aside_redone
    from operators.review.outputs import read_current
    from operators.review.summary import summarize_reviews
    reviews = read_current(Store(uri), "review")
    if reviews is None or not len(reviews):
        return None
    stale = []
    for kind, src in (("captions", caps), ("qa", qa)):
        mine = reviews[reviews["kind"] == kind] if "kind" in reviews else reviews.iloc[0:0]
        if src is not None and src.table is not None and len(mine):
            stale += reviewed_on_other_text(mine, review_items(kind, src.table, None))
    out = summarize_reviews(set_aside_redone(reviews, stale))
    out["reviewed_on_other_text"] = stale
    return out


def annotation_facts(caps: LanguageSource | None, qa: LanguageSource | None, review: dict | None) -> dict:
    """Key facts of how the annotations were made (the card's list and Croissant's RAI fields)."""
    facts = {}
    for what, src in (("captions", caps), ("qa", qa)):
        if src is None:
            continue
        runs = src.runs
        facts[f"{what} generator models"] = ", ".join(sorted({str(r.get("model")) for r in runs})) or "not recorded"
        facts[f"{what} judge models"] = ", ".join(sorted({str(r.get("judge_model")) for r in runs})) or "not recorded"
        prompts = sorted({str(v) for r in runs for k, v in r.items() if "prompt" in k})
        facts[f"{what} prompt versions"] = ", ".join(prompts) or "not recorded"
        facts[f"{what} selection"] = SELECTION["Captions" if what == "captions" else "QA"]
        facts[f"{what} validators"] = _validators(runs, src.table)
    if caps or qa:
        if review:
            acc = review["acceptance"]
            lo, hi = acc.get("wilson95") or (None, None)
            kappa = review["judge_agreement"]["cohens_kappa"]
            facts["human review"] = (f"{review['reviewed']} of {review['tasks']} sampled items reviewed; acceptance "
                                     f"{acc['accepted']}/{acc['n']}" + (f" (Wilson 95% {lo:.3f}-{hi:.3f})" if lo is not None else "")
                                     + f"; human-judge agreement Cohen's kappa {kappa if kappa is None else round(kappa, 3)}"
                                     + (f"; {len(review['reviewed_on_other_text'])} sampled item(s) unreviewed since "
                                        "redone (their text changed after the review: their verdicts are left out of "
                                        "these figures)" if review.get("reviewed_on_other_text") else ""))
        else:
            facts["human review"] = "none recorded for this release"
    return facts


def _validators(runs: list[dict], table) -> str:
    """Validator mode, the grounded rules, and how many candidates broke one."""
    from operators.language.validators import RULES
    modes = ", ".join(sorted({str(r.get("validators")) for r in runs if r.get("validators")}))
    if not modes:
        return "not recorded"
    text = f"{modes} (rules checked against the change mask: {', '.join(RULES)}"
    if table is not None and "validator_ok" in table:
        ok = table["validator_ok"]
        text += f"; {int((ok == False).sum())} of {int(ok.notna().sum())} checked candidates broke a rule"  # noqa: E712
    return text + ")"


def limitations(dataset: DatasetSource, counts: dict, excluded: list, captions: bool, qa: bool,
                review: dict | None, two_maps: bool, classes=None) -> list[str]:
    out = []
    empty = [s for s, n in counts.items() if not n]
    if empty:
        out.append(f"Empty split(s): {', '.join(empty)} (splits are drawn per location; few locations leave some empty).")
    if excluded:
        out.append(f"{len(excluded)} input pair(s) or file(s) were not published; `excluded.json` gives each reason.")
    if dataset.kind == "pairs_job":
        out.append("Pairs are co-registered by a homography per slice and screened by residual; parallax of tall "
                   "objects and residuals up to the screening limit remain.")
    if classes is not None and classes.declared and not classes.per_class:
        c = classes.classes[0]
        out.append(f"One change class ({c.name}, drawn on the {c.image}-change image): masks do not separate kinds "
                   "of change.")
    elif classes is not None and classes.declared and not two_maps:
        out.append("No pair has the per-class maps label_classes.json names; only the union mask is published.")
    elif not two_maps:
        out.append("Masks do not separate new from demolished buildings (no label1/label2 in the input).")
    if captions or qa:
        out.append("Captions and QA are generated and judged by language models; they can be wrong even when "
                   "selected" + ("" if review else ", and no human review is recorded for this release") + ".")
    out.append("Images are 8-bit renderings (percentile stretch) of the source scenes, not calibrated reflectance.")
    return out


def rai_fields(language: dict, limits: list[str], dataset: DatasetSource, masks: dict | None = None) -> dict:
    """Croissant Responsible-AI fields. ``masks``: the change masks' fields
    (:func:`operators.publish.provenance.rai`, from the dataset's annotation summary)."""
    from operators.publish import provenance
    masks = dict(masks or provenance.rai(None))
    collection = ("Bitemporal slices cut from satellite scenes of one place at two dates, co-registered and "
                  "screened by changeforge's pairs job (S2Looking recipe)." if dataset.kind == "pairs_job" else
                  "Bitemporal image pairs read from a LEVIR-CD layout.")
    protocol = "; ".join(f"{k}: {v}" for k, v in language.items())
    tools = list(masks.pop("rai:machineAnnotationTools", []))
    tools += [f"{k}: {v}" for k, v in language.items() if k.endswith(("generator models", "judge models"))]
    out = {
        "rai:dataCollection": collection,
        "rai:dataCollectionType": "Secondary Data Analysis",
        "rai:dataAnnotationProtocol": masks.pop("rai:dataAnnotationProtocol")
                                      + (f" Captions and QA: {protocol}." if protocol else ""),
        "rai:dataAnnotationPlatform": "changeforge jobs (OpenAI-compatible LLM endpoint; Label Studio for human review)",
        "rai:annotationsPerItem": "one change mask; up to 3 selected captions; up to 5 selected QA pairs",
        "rai:dataLimitations": " ".join(limits),
        "rai:dataBiases": "Places and dates follow the source archive; LLM annotations inherit the models' biases.",
        "rai:dataUseCases": "Training and evaluating bitemporal change detection, change captioning and change QA.",
        "rai:dataReleaseMaintenancePlan": "Versioned releases; CHANGELOG.md lists pairs added, removed and changed.",
    }
    out.update(masks)
    if tools:
        out["rai:machineAnnotationTools"] = tools
    return out
