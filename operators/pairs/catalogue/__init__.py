"""Cataloguing scenes: scene inputs and headers, STAC items, per-band manifests and band stacks."""
