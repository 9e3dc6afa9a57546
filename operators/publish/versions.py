"""Integrity and versions of releases: the ``SHA256SUMS`` manifest (the format ``sha256sum -c`` reads),
semantic versions, the pairs' content digests, the change list between two versions and ``CHANGELOG.md``,
and the code version a release was built with.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess

SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?$")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_version(text: str) -> tuple:
    """A sortable key of a semantic version; ValueError when ``text`` is not one (e.g. ``1.0.0``)."""
    m = SEMVER.match(text or "")
    if not m:
        raise ValueError(f"{text!r} is not a semantic version (MAJOR.MINOR.PATCH, e.g. 1.0.0)")
    major, minor, patch, pre = m.groups()
    # A pre-release sorts before its release (1.0.0-rc.1 < 1.0.0).
    return int(major), int(minor), int(patch), (0, pre) if pre else (1, "")


def previous_version(versions: list[str], current: str) -> str | None:
    """The highest version below ``current`` among ``versions`` (None when there is none)."""
    key = parse_version(current)
    older = [v for v in versions if parse_version(v) < key]
    return max(older, key=parse_version) if older else None


def sha256sums(hashes: dict[str, str]) -> str:
    """``<hex>  <path>`` lines sorted by path, as ``sha256sum`` writes them (text mode, two spaces)."""
    for path in hashes:
        if "\n" in path or "\\" in path:
            raise ValueError(f"path {path!r} cannot be written to a checksum file")
    return "".join(f"{h}  {p}\n" for p, h in sorted(hashes.items()))


def parse_sha256sums(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.strip():
            digest, path = line.split(None, 1)
            out[path.lstrip("*").strip()] = digest
    return out


def pair_digest(file_hashes: dict[str, str], split: str, captions: list[str], qa: list[dict]) -> str:
    """One digest of everything a pair is in a release: its files' hashes by role, split, captions, QA."""
    doc = {"files": dict(sorted(file_hashes.items())), "split": split, "captions": captions, "qa": qa}
    return sha256(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode())


def diff_pairs(old: dict[str, dict], new: dict[str, dict]) -> dict[str, list[str]]:
    """Pairs added, removed and changed between two releases' ``{id: {"digest", "split"}}`` indexes."""
    return {"added": sorted(set(new) - set(old)), "removed": sorted(set(old) - set(new)),
            "changed": sorted(k for k in set(old) & set(new) if old[k]["digest"] != new[k]["digest"])}


def changelog_entry(version: str, date: str, previous: str | None, changes: dict[str, list[str]],
                    counts: dict[str, int], listed: int = 200) -> str:
    """A Markdown section of ``CHANGELOG.md`` for one version (ids listed up to ``listed`` per kind;
    ``changes.json`` holds them all)."""
    total = sum(counts.values())
    lines = [f"## {version} ({date})", ""]
    split_text = ", ".join(f"{k} {v}" for k, v in counts.items())
    if previous is None:
        lines.append(f"First release: {total} pairs ({split_text}).")
    else:
        lines.append(f"Compared with {previous}: {len(changes['added'])} pairs added, {len(changes['removed'])} "
                     f"removed, {len(changes['changed'])} changed; {total} pairs ({split_text}).")
        for kind in ("added", "removed", "changed"):
            ids = changes[kind]
            if ids:
                more = f" and {len(ids) - listed} more (changes.json)" if len(ids) > listed else ""
                lines += ["", f"- {kind.capitalize()}: " + ", ".join(f"`{i}`" for i in ids[:listed]) + more]
    return "\n".join(lines) + "\n"


def changelog(entry: str, previous_text: str | None) -> str:
    """``CHANGELOG.md``: this version's entry on top of the previous release's entries."""
    head = "# Changelog\n\n"
    older = previous_text[len(head):] if previous_text and previous_text.startswith(head) else (previous_text or "")
    return head + entry + ("\n" + older if older else "")


def code_version() -> dict:
    """The package version and, when run from a git checkout, its commit and whether it had edits."""
    from importlib import metadata
    try:
        package = metadata.version("changeforge")
    except metadata.PackageNotFoundError:
        package = None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = {"package": package, "commit": None, "dirty": None}
    try:
        out["commit"] = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                       text=True, timeout=10, check=True).stdout.strip() or None
        status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
        out["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out
