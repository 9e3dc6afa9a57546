"""The chain's logic (pure where it can be): option translation, what a step needs, fingerprints of the
people's work, and which steps a run must run. ``jobs/chain.py`` wires it."""
