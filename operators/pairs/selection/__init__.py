"""Choosing what to cut: pairing scenes, assigning splits, slicing a pair into windows."""
