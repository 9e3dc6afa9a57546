"""The dataset layout every job reads: LEVIR-CD's ``A/ B/ label/`` (at the root or under ``train/ val/
test/``), the split lists ``list/{train,val,test}.txt`` and a pairs job's ``metadata/`` table.
(``source.json``, which leads one job's output back to its dataset, is :mod:`operators.io.sources`.)"""
from __future__ import annotations

import posixpath

from operators.io.storage import Store, read_uri

SPLITS = ("train", "val", "test")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")


def _stem(name: str) -> str:
    return posixpath.splitext(posixpath.basename(name))[0]


def _split_of(name: str, default: str) -> str:
    prefix = posixpath.basename(name).split("_", 1)[0].lower()
    return prefix if prefix in SPLITS else default


def split_lists(store: Store) -> dict[str, str]:
    """``{stem: split}`` from ``list/train.txt``, ``list/val.txt`` and ``list/test.txt`` at the
    dataset's root (the pairs job writes them; LEVIR-CD's loaders read them); ``{}`` without them."""
    out: dict[str, str] = {}
    for split in SPLITS:
        rel = f"list/{split}.txt"
        if store.exists(rel):
            for line in store.read_bytes(rel).decode().splitlines():
                if line.strip():
                    out[_stem(line.strip())] = split
    return out


def is_pairs_output(store: Store) -> bool:
    """A pairs job's output (its ``metadata/`` table next to ``A/ B/``): masks come later, from
    annotation, so a pair without one is not annotated yet rather than broken."""
    return bool(store.list("metadata", suffixes=(".parquet",), recursive=False))


NO_MASK_YET = "no change mask in label/ yet (not annotated)"

# A pair of a LEVIR-CD dataset whose A and B exist but whose label/ mask does not: an input condition,
# not a failure of the run. The captions and QA jobs record it once in errors/ (error type NO_MASK_ERROR,
# stage "prepare", the message starting with NO_MASK), send it to no worker, and never count it among
# the pairs a run failed (operators.io.console.llm_run_shortfall).
NO_MASK = "no mask"
NO_MASK_ERROR = "NoMask"


def lacks_mask(pair: dict) -> bool:
    """A pair whose images A and B were found but whose ``label/`` mask was not (a pair missing A or B
    too is a broken pair: its error comes from preparing it)."""
    return not pair.get("label_rel") and bool(pair.get("a_rel")) and bool(pair.get("b_rel"))


def no_mask_message(pair: dict) -> str:
    """The ``errors/`` message of a pair without a mask (names the condition first, then the file)."""
    return (f"{NO_MASK}: missing change mask (label) for {pair.get('filename') or pair.get('pair_id')}; "
            "the pair is left out until label/ has one")


def find_dataset_pairs(input_uri: str, list_file: str | None = None,
                       default_split: str = "train") -> tuple[list[dict], dict[str, int]]:
    """:func:`discover_pairs`, and for a pairs job's output the pairs left out with a counted reason:
    accepted slices whose ``label/`` mask does not exist yet are skipped (``{reason: count}``),
    not made one error row each. Any other dataset keeps every pair (a missing file is the pair's
    error row)."""
    pairs = discover_pairs(input_uri, list_file, default_split)
    if not is_pairs_output(Store(input_uri)):
        return pairs, {}
    kept = [p for p in pairs if not lacks_mask(p)]
    skipped = len(pairs) - len(kept)
    return kept, ({NO_MASK_YET: skipped} if skipped else {})


def discover_pairs(input_uri: str, list_file: str | None = None, default_split: str = "train") -> list[dict]:
    """Pairs in a LEVIR-CD layout: ``A/ B/ label/`` at the root or under ``train/ val/ test/``.

    A name present in any of the three folders (or in the list file) is a pair; what is missing is
    reported when the pair is prepared, so it ends as an error row rather than vanishing. The split is
    the split folder, else the ``list/{train,val,test}.txt`` file naming the pair (a pairs job's
    output), else a ``train_``/``val_``/``test_`` file-name prefix, else ``default_split``.
    """
    store = Store(input_uri)
    roots = [("", None)] if store.list("A", suffixes=IMAGE_SUFFIXES) or not any(
        store.list(f"{s}/A", suffixes=IMAGE_SUFFIXES) for s in SPLITS) else \
        [(s, s) for s in SPLITS if store.list(f"{s}/A", suffixes=IMAGE_SUFFIXES)]
    wanted = None
    if list_file:
        # Relative to the dataset (e.g. list/demo.txt), or any local path or s3:// URI.
        inside = "://" not in list_file and not list_file.startswith("/") and store.exists(list_file)
        text = (store.read_bytes(list_file) if inside else read_uri(list_file)).decode()
        wanted = [ln.strip() for ln in text.splitlines() if ln.strip()]
    listed = split_lists(store) if roots == [("", None)] else {}
    pairs = []
    for base, split in roots:
        prefix = f"{base}/" if base else ""
        files: dict[str, dict[str, str]] = {}
        stamps: dict[str, dict[str, str]] = {}   # each file's stamp, for resuming by lineage
        for folder in ("A", "B", "label"):
            for rel, stamp in store.stamps(f"{prefix}{folder}", suffixes=IMAGE_SUFFIXES).items():
                files.setdefault(_stem(rel), {})[folder] = posixpath.basename(rel)
                stamps.setdefault(_stem(rel), {})[folder] = stamp
        names = sorted(files) if wanted is None else sorted({_stem(w) for w in wanted})
        for stem in names:
            found = files.get(stem, {})
            filename = found.get("A") or found.get("B") or found.get("label") or f"{stem}.png"
            pairs.append({
                "pair_id": f"{prefix}{stem}", "split": split or listed.get(stem) or _split_of(stem, default_split),
                "filename": filename, "root": store.uri(),
                **{f"{k.lower()}_rel": (f"{prefix}{k}/{found[k]}" if k in found else "") for k in ("A", "B", "label")},
                **{f"{k.lower()}_stamp": stamps[stem][k] for k in ("A", "B", "label") if k in stamps.get(stem, {})},
            })
    return pairs
