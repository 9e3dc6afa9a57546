"""Change proposals as a Ray Data map: one pair in, its proposal mask written as a 0/255 PNG under
``<out_root>/prelabels/<method>/<pair_id>.png`` and one small row out (or an error row)."""
from __future__ import annotations

import time

from operators.annotation.proposals import ProposalConfig, propose
from operators.io.images import decode_image, write_png
from operators.io.storage import Store
from operators.io.tables import envelope, error_envelope

JOB = "annotate"


def proposal_rel(method: str, pair_id: str) -> str:
    return f"prelabels/{method}/{pair_id}.png"


def propose_pair(row: dict, method: str, out_root: str, config: ProposalConfig = ProposalConfig(),
                 run_id: str = "") -> list[dict]:
    """flat_map: ``{pair_id, root, a_rel, b_rel}`` -> a ``proposals`` envelope or an ``errors`` one."""
    try:
        store = Store(row["root"])
        a = decode_image(store.read_bytes(row["a_rel"]))
        b = decode_image(store.read_bytes(row["b_rel"]))
        t0 = time.perf_counter()
        p = propose(method, a, b, config)
        seconds = time.perf_counter() - t0
        rel = proposal_rel(method, row["pair_id"])
        write_png(Store(out_root), rel, (p.mask * 255).astype("uint8"))
        return [envelope("proposals", {"pair_id": row["pair_id"], "method": method, "mask_rel": rel,
                                       "score": float(p.score), "pixels": int(p.mask.sum()), "seconds": seconds})]
    except Exception as exc:  # noqa: BLE001 - every pair ends in a table
        return [error_envelope(row["pair_id"], f"proposal:{method}", exc, job=JOB, run_id=run_id)]


def run_proposals(rows: list[dict], method: str, out_root: str, config: ProposalConfig = ProposalConfig(),
                  run_id: str = "") -> tuple[list[dict], list[dict]]:
    """Every pair through :func:`propose_pair` on Ray Data; returns (proposal rows, error rows)."""
    import json

    import ray.data
    if not rows:
        return [], []
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), 64)))
    out = ds.flat_map(propose_pair, fn_kwargs={"method": method, "out_root": out_root, "config": config,
                                               "run_id": run_id}).take_all()
    found: dict[str, list[dict]] = {"proposals": [], "errors": []}
    for env in out:
        found[env["_table"]].append(json.loads(env["_record"]))
    return found["proposals"], found["errors"]
