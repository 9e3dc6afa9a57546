"""The regional registration graph: tiles of shared features and matches, and its Ray operators."""
