"""The annotation scheme: which classes are drawn on which image, and the Label Studio labeling
interface for it.

S2Looking's annotators draw two label maps per pair: new buildings on the post-change image and
demolished buildings on the pre-change image (``new:post,demolished:pre``, the default). A
single-map scheme such as LEVIR-CD's or JL1-CD's is one class, e.g. ``change:post``. Class *i*
(in the order given) becomes ``label<i>/`` of the dataset; their union is ``label/``.
"""
from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

IMAGES = ("pre", "post")
DEFAULT_CLASSES = "new:post,demolished:pre"
COLOURS = ("#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


@dataclass(frozen=True)
class ChangeClass:
    name: str
    image: str          # pre | post: the image the class is drawn on
    folder: str         # label1, label2, ...
    colour: str


def parse_classes(text: str) -> list[ChangeClass]:
    """``name:image,...`` -> classes in order; raises ValueError on a malformed or repeated entry."""
    out: list[ChangeClass] = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        name, _, image = part.partition(":")
        name, image = name.strip(), (image.strip() or "post")
        if not name or image not in IMAGES or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"--classes entry {part!r}: expected <name>:pre or <name>:post (letters, digits, - and _)")
        if any(c.name == name for c in out):
            raise ValueError(f"--classes names {name!r} twice")
        out.append(ChangeClass(name, image, f"label{i + 1}", COLOURS[i % len(COLOURS)]))
    if not out:
        raise ValueError("--classes names no class")
    return out


def control_name(image: str, tool: str) -> str:
    """The labeling interface's control drawing on ``image`` with ``tool`` (brush | polygon)."""
    return f"{image}_{tool}"


def labeling_config(classes: list[ChangeClass]) -> str:
    """Pre and post side by side; on each, a brush and a polygon tool for the classes drawn there."""
    panes = []
    for image, title in (("pre", "Before (pre-change)"), ("post", "After (post-change)")):
        mine = [c for c in classes if c.image == image]
        controls = ""
        if mine:
            labels = "".join(f'<Label value="{escape(c.name)}" background="{c.colour}"/>' for c in mine)
            controls = (f'<BrushLabels name="{control_name(image, "brush")}" toName="{image}">{labels}</BrushLabels>'
                        f'<PolygonLabels name="{control_name(image, "polygon")}" toName="{image}" strokeWidth="2" '
                        f'pointSize="small" opacity="0.5">{labels}</PolygonLabels>')
        panes.append(f'<View style="flex: 1 1 50%; min-width: 0"><Header value="{title}" size="5"/>'
                     f'<Image name="{image}" value="${image}" zoom="true" zoomControl="true"/>{controls}</View>')
    # The pair's quality: 'unusable' with its reasons excludes the pair; 'needs expert' hands it on
    # (operators.annotation.decisions reads these values).
    from operators.annotation.decisions import QUALITY_CHOICES
    choices = "".join(f'<Choice value="{escape(q)}"/>' for q in QUALITY_CHOICES)
    quality = ('  <Header value="Pair quality (leave empty when the pair can be annotated)" size="5"/>\n'
               f'  <Choices name="quality" toName="post" choice="multiple" showInline="true">{choices}</Choices>\n')
    return ('<View>\n  <Header value="$title"/>\n'
            '  <Text name="instructions" value="$instructions"/>\n'
            '  <View style="display: flex; gap: 12px">\n    ' + "\n    ".join(panes) + "\n  </View>\n" + quality +
            "</View>\n")


# ---------------------------------------------------------------------------------------------------
# The scheme travels with the dataset: export writes it, ingest, captions, the report and publish read it,
# so a mask folder is always named by its class, never assumed from its position.
# ---------------------------------------------------------------------------------------------------
SCHEME_FILE = "label_classes.json"
SCHEME_VERSION = 1


def scheme_document(classes: list[ChangeClass]) -> dict:
    """The ``label_classes.json`` document: classes in order, the image each is drawn on, its folder,
    and the folder holding their union (``label/``)."""
    return {"version": SCHEME_VERSION, "union": "label",
            "classes": [{"name": c.name, "image": c.image, "folder": c.folder} for c in classes]}


def classes_from_document(doc: dict) -> list[ChangeClass]:
    """Classes from a ``label_classes.json`` document; ValueError on a malformed one."""
    if not isinstance(doc, dict) or not isinstance(doc.get("classes"), list) or not doc["classes"]:
        raise ValueError(f"{SCHEME_FILE}: expected an object with a non-empty 'classes' list")
    out: list[ChangeClass] = []
    for i, entry in enumerate(doc["classes"]):
        try:
            name, image, folder = str(entry["name"]), str(entry["image"]), str(entry["folder"])
        except (KeyError, TypeError):
            raise ValueError(f"{SCHEME_FILE}: class {i + 1} needs 'name', 'image' and 'folder'") from None
        if image not in IMAGES:
            raise ValueError(f"{SCHEME_FILE}: class {name!r} is drawn on {image!r}, expected pre or post")
        out.append(ChangeClass(name, image, folder, COLOURS[i % len(COLOURS)]))
    if len({c.name for c in out}) != len(out) or len({c.folder for c in out}) != len(out):
        raise ValueError(f"{SCHEME_FILE}: class names and folders must be unique")
    return out


def write_scheme(store, classes: list[ChangeClass]) -> None:
    """Write ``label_classes.json`` at the root of ``store`` (an :class:`operators.io.storage.Store`)."""
    import json
    store.write_bytes(SCHEME_FILE, (json.dumps(scheme_document(classes), indent=2) + "\n").encode())


def read_scheme(store) -> list[ChangeClass] | None:
    """The dataset's class scheme from ``label_classes.json``, or None when the dataset has none."""
    import json
    if not store.exists(SCHEME_FILE):
        return None
    try:
        doc = json.loads(store.read_bytes(SCHEME_FILE))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{SCHEME_FILE}: not JSON ({exc.msg} at line {exc.lineno})") from None
    return classes_from_document(doc)
