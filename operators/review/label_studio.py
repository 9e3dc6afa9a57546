"""Label Studio's side of the review, as plain data: the labeling config (XML), the tasks (JSON) with
the judge's score pre-filled as a prediction, and the reviewers' annotations read back from an export.

A task shows the pre image, the post image and the change mask side by side above the text (a caption,
or a question and its answer), and asks for

- ``verdict``: correct / partly correct / wrong (required),
- ``error_category``: hallucinated object, wrong location, wrong magnitude, wrong count, vague, other
  (any number of them),
- ``corrected``: the text as it should read (optional),
- ``judge_score``: the LLM judge's overall score, pre-filled from the prediction (reviewers may change it).

Images are URLs (Label Studio local-files serving or presigned S3 URLs), never inline base64: tasks stay
small and the images stay where the dataset keeps them.
"""
from __future__ import annotations

import math
from xml.sax.saxutils import quoteattr

VERDICTS = ("correct", "partly correct", "wrong")
ERROR_CATEGORIES = ("hallucinated object", "wrong location", "wrong magnitude", "wrong count", "vague", "other")
KINDS = ("captions", "qa")
MODEL_VERSION_PREFIX = "llm-judge"


def labeling_config(kind: str) -> str:
    """The labeling config XML for captions or QA pairs."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    what = "caption" if kind == "captions" else "question and answer"
    facet = "perspective" if kind == "captions" else "question type"
    corrected = "corrected caption" if kind == "captions" else "corrected answer"

    def choices(values):
        return "\n".join(f"      <Choice value={quoteattr(v)}/>" for v in values)

    panel = "\n".join(
        f'    <View style="flex: 1; min-width: 200px">\n'
        f'      <Header value="{title}" size="5"/>\n'
        f'      <Image name="{name}" value="${name}" zoomControl="true" width="100%"/>\n'
        f'    </View>' for name, title in (("pre", "Before (A)"), ("post", "After (B)"), ("mask", "Change mask")))
    return f"""<View>
  <Header value="$title"/>
  <View style="display: flex; gap: 12px; flex-wrap: wrap">
{panel}
  </View>
  <Header value="The {what} ({facet}: $facet)" size="5"/>
  <Text name="text" value="$text"/>
  <Header value="Is the {what} right about the change?" size="5"/>
  <Choices name="verdict" toName="text" choice="single-radio" showInline="true" required="true">
{choices(VERDICTS)}
  </Choices>
  <Header value="Error category (if not correct)" size="5"/>
  <Choices name="error_category" toName="text" choice="multiple" showInline="true">
{choices(ERROR_CATEGORIES)}
  </Choices>
  <Header value="{corrected[0].upper() + corrected[1:]} (optional)" size="5"/>
  <TextArea name="corrected" toName="text" editable="true" maxSubmissions="1" rows="3"
            placeholder="Write the {corrected} here if it needs fixing"/>
  <Header value="LLM judge's overall score (pre-filled; $judge_reason)" size="5"/>
  <Rating name="judge_score" toName="text" maxRating="10"/>
</View>
"""


def task(item: dict, urls: dict[str, str], kind: str, judge_model: str = "") -> dict:
    """One Label Studio task for one sampled item.

    ``item`` carries the review fields (see :func:`jobs.review` export): ``item_id``, ``pair_id``,
    ``text``, ``facet``, ``overall`` ... ; ``urls`` the ``pre``, ``post`` and ``mask`` image URLs."""
    overall = item.get("overall")
    data = {
        "pre": urls["pre"], "post": urls["post"], "mask": urls["mask"],
        "title": f"{item['pair_id']} ({item.get('split') or 'no split'}, change area "
                 f"{_pct(item.get('car'))}, {item.get('car_class', 'unknown')})",
        "text": item["text"], "facet": item.get("facet") or "",
        "judge_reason": item.get("judge_reason") or "no reason given",
        **{k: _plain(item.get(k)) for k in ("item_id", "kind", "pair_id", "filename", "split", "index",
                                            "car", "car_class", "overall", "judge_accept", "selected",
                                            "stratum", "stratum_size", "stratum_sampled", "run_id", "source",
                                            "lineage")},
    }
    data["kind"] = kind
    out = {"data": data}
    if overall is not None and not (isinstance(overall, float) and math.isnan(overall)):
        score = int(round(float(overall)))
        out["predictions"] = [{
            "model_version": f"{MODEL_VERSION_PREFIX}:{judge_model or 'unknown'}",
            "score": float(overall) / 10.0,
            "result": [{"from_name": "judge_score", "to_name": "text", "type": "rating",
                        "value": {"rating": max(1, min(10, score))}}],
        }]
    return out


def _pct(car) -> str:
    return "unknown" if car is None or car != car else f"{100 * float(car):.1f}%"


def _plain(value):
    """JSON-safe scalars (numpy and NaN out)."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def annotation_fields(result: list[dict]) -> dict:
    """Verdict, error categories, corrected text and judge score from one annotation's ``result``."""
    out = {"verdict": None, "error_categories": [], "corrected_text": None, "human_judge_score": None}
    for r in result or []:
        name, value = r.get("from_name"), r.get("value") or {}
        if name == "verdict" and value.get("choices"):
            out["verdict"] = value["choices"][0]
        elif name == "error_category":
            out["error_categories"] = list(value.get("choices") or [])
        elif name == "corrected":
            text = "\n".join(t for t in (value.get("text") or []) if t).strip()
            out["corrected_text"] = text or None
        elif name == "judge_score" and value.get("rating") is not None:
            out["human_judge_score"] = int(value["rating"])
    return out


def review_rows(export: list[dict]) -> list[dict]:
    """One row per submitted annotation in a Label Studio JSON export; a task nobody annotated (or whose
    annotations were all skipped) gives one row with ``status`` ``unreviewed`` so that it is counted,
    not lost. Rows carry the task's item fields (pair id, kind, facet, judge verdict ...)."""
    rows = []
    for t in export:
        data = t.get("data") or {}
        base = {"task_id": int(t["id"]), **{k: data.get(k) for k in (
            "item_id", "kind", "pair_id", "filename", "split", "index", "facet", "text", "car", "car_class",
            "overall", "judge_accept", "selected", "stratum", "stratum_size", "stratum_sampled", "run_id", "source",
            "lineage")}}
        done = [a for a in (t.get("annotations") or []) if not a.get("was_cancelled")]
        if not done:
            rows.append({**base, "annotation_id": -1, "status": "unreviewed", "annotator": None,
                         "annotated_at": None, **annotation_fields([])})
            continue
        for a in done:
            fields = annotation_fields(a.get("result") or [])
            rows.append({**base, "annotation_id": int(a["id"]),
                         "status": "reviewed" if fields["verdict"] else "no verdict",
                         "annotator": str(a.get("completed_by")) if a.get("completed_by") is not None else None,
                         "annotated_at": a.get("updated_at") or a.get("created_at"), **fields})
    return rows
