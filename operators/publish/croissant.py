"""Croissant 1.0 metadata of a release (``croissant.json``, JSON-LD), written directly: the Parquet shards as
``FileObject``s (with their SHA-256) and a ``FileSet``, the folder layout's PNGs and JSON files as
``FileSet``s, ``RecordSet``s for the pairs (images decoded from the Parquet image columns), captions
and QA, and the Responsible-AI (``rai:``) fields on how the annotations were made.
"""
from __future__ import annotations

CONTEXT = {
    "@language": "en", "@vocab": "https://schema.org/", "citeAs": "cr:citeAs", "column": "cr:column",
    "conformsTo": "dct:conformsTo", "equivalentProperty": "cr:equivalentProperty", "cr": "http://mlcommons.org/croissant/",
    "rai": "http://mlcommons.org/croissant/RAI/", "data": {"@id": "cr:data", "@type": "@json"},
    "dataType": {"@id": "cr:dataType", "@type": "@vocab"}, "dct": "http://purl.org/dc/terms/",
    "examples": {"@id": "cr:examples", "@type": "@json"}, "extract": "cr:extract", "field": "cr:field",
    "fileProperty": "cr:fileProperty", "fileObject": "cr:fileObject", "fileSet": "cr:fileSet",
    "format": "cr:format", "includes": "cr:includes", "isLiveDataset": "cr:isLiveDataset",
    "jsonPath": "cr:jsonPath", "key": "cr:key", "md5": "cr:md5", "parentField": "cr:parentField",
    "path": "cr:path", "recordSet": "cr:recordSet", "references": "cr:references", "regex": "cr:regex",
    "repeated": "cr:repeated", "replace": "cr:replace", "samplingRate": "cr:samplingRate", "sc": "https://schema.org/", "separator": "cr:separator",
    "source": "cr:source", "subField": "cr:subField", "transform": "cr:transform",
}
PARQUET = "application/x-parquet"
PARQUET_SET = "parquet-shards"
SPDX = "https://spdx.org/licenses/{}.html"


def _field(rs: str, name: str, data_type: str, description: str, column: str | None = None,
           json_path: str | None = None, **extra) -> dict:
    source = {"fileSet": {"@id": PARQUET_SET}, "extract": {"column": column or name}}
    if json_path:
        source["transform"] = {"jsonPath": json_path}
    return {"@type": "cr:Field", "@id": f"{rs}/{name}", "name": name, "description": description,
            "dataType": data_type, "source": source, **extra}


def pairs_record_set(has_two_maps: bool, classes=None) -> dict:
    """The ``pairs`` record set; per-class mask fields (named by the release's classes,
    :class:`operators.publish.classes.ReleaseClasses`) when the maps are there."""
    from operators.publish.classes import S2LOOKING, ReleaseClasses
    classes = classes or ReleaseClasses(S2LOOKING, False)
    rs = "pairs"
    fields = [
        _field(rs, "id", "sc:Text", "pair id (file-name stem in the folder layout)"),
        _field(rs, "split", "sc:Text", "train, val or test"),
        _field(rs, "pre", "sc:ImageObject", "pre-change image (A)", json_path="bytes"),
        _field(rs, "post", "sc:ImageObject", "post-change image (B)", json_path="bytes"),
        _field(rs, "mask", "sc:ImageObject", "change mask, 0 = no change, 255 = change", json_path="bytes"),
        _field(rs, "car", "sc:Float", "change area ratio (changed / all pixels)"),
        _field(rs, "changed_pixels", "sc:Integer", "pixels marked changed"),
        _field(rs, "width", "sc:Integer", "width in pixels"),
        _field(rs, "height", "sc:Integer", "height in pixels"),
        _field(rs, "location", "sc:Text", "location id (null for LEVIR-CD inputs)"),
        _field(rs, "pre_date", "sc:Text", "acquisition date of the pre image"),
        _field(rs, "post_date", "sc:Text", "acquisition date of the post image"),
        _field(rs, "sensor", "sc:Text", "platform of the source scenes, when known"),
    ]
    if has_two_maps and classes.per_class and classes.declared:
        for c in classes.classes:
            fields.append(_field(rs, classes.column(c), "sc:ImageObject",
                                 f"{classes.describe(c)}: 0 = none, 255 = marked ({c.folder}/)", json_path="bytes"))
    if has_two_maps:
        values = ", ".join(f"{v} = {n}" for v, n in classes.index_values().items())
        fields += [_field(rs, "mask_index", "sc:ImageObject", f"index mask {values}", json_path="bytes")]
    return {"@type": "cr:RecordSet", "@id": rs, "name": rs, "key": {"@id": f"{rs}/id"},
            "description": "one record per bitemporal pair", "field": fields}


def _list_record_set(rs: str, column: str, description: str, text: str) -> dict:
    return {"@type": "cr:RecordSet", "@id": rs, "name": rs, "description": description, "field": [
        _field(rs, "id", "sc:Text", "pair id"),
        _field(rs, column, "sc:Text", text, repeated=True)]}


def qa_record_set() -> dict:
    """Per pair, its selected QA pairs: a repeated field with ``type``, ``question`` and ``answer`` sub-fields
    read from the Parquet ``qa`` column (a list of structs)."""
    def sub(name: str, text: str) -> dict:
        return {"@type": "cr:Field", "@id": f"qa/qa/{name}", "name": name, "description": text, "dataType": "sc:Text",
                "source": {"fileSet": {"@id": PARQUET_SET}, "extract": {"column": "qa"},
                           "transform": {"jsonPath": f"[*].{name}"}}}
    return {"@type": "cr:RecordSet", "@id": "qa", "name": "qa",
            "description": "selected question-answer pairs per image pair", "field": [
                _field("qa", "id", "sc:Text", "pair id"),
                {"@type": "cr:Field", "@id": "qa/qa", "name": "qa", "description": "selected QA pairs", "repeated": True,
                 "subField": [sub("type", "question type"), sub("question", "question"), sub("answer", "answer")]}]}


def document(*, name: str, version: str, date: str, licence: str, description: str, shards: dict[str, str],
             has_captions: bool, has_qa: bool, has_two_maps: bool, rai: dict, url: str = "", classes=None) -> dict:
    """The JSON-LD document. ``shards``: Parquet path -> SHA-256."""
    files = [{"@type": "cr:FileObject", "@id": rel, "name": rel, "contentUrl": rel, "encodingFormat": PARQUET,
              "sha256": digest} for rel, digest in sorted(shards.items())]
    files.append({"@type": "cr:FileSet", "@id": PARQUET_SET, "name": PARQUET_SET,
                  "description": "Parquet shards, one row per pair, images as PNG bytes",
                  "encodingFormat": PARQUET, "includes": "data/*.parquet"})
    folders = classes.folders if classes is not None else ["label1", "label2"]
    roles = ["A", "B", "label"] + ([*folders, "label_index"] if has_two_maps else [])
    for role in roles:
        files.append({"@type": "cr:FileSet", "@id": f"png-{role}", "name": f"png-{role}",
                      "description": f"folder layout: <split>/{role}/<id>.png", "encodingFormat": "image/png",
                      "includes": f"*/{role}/*.png"})
    for what, on in (("captions", has_captions), ("qa", has_qa)):
        if on:
            files.append({"@type": "cr:FileSet", "@id": f"{what}-json", "name": f"{what}-json",
                          "description": f"folder layout: <split>/{what}.json", "encodingFormat": "application/json",
                          "includes": f"*/{what}.json"})
    record_sets = [pairs_record_set(has_two_maps, classes)]
    if has_captions:
        record_sets.append(_list_record_set("captions", "captions", "selected change captions per pair",
                                            "selected captions"))
    if has_qa:
        record_sets.append(qa_record_set())
    doc = {
        "@context": CONTEXT, "@type": "sc:Dataset", "conformsTo": "http://mlcommons.org/croissant/1.0",
        "name": name, "description": description, "version": version, "datePublished": date,
        "license": SPDX.format(licence), **({"url": url} if url else {}),
        "citeAs": f"{name} {version} ({date[:4]}), built with changeforge",
        "keywords": ["change detection", "remote sensing", "bitemporal", "change captioning", "change QA"],
        "creator": {"@type": "sc:Organization", "name": "changeforge"},
        "distribution": files, "recordSet": record_sets, **rai,
    }
    return doc
