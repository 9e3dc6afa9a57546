"""Screening a registered crop: the dense shift field, its acceptance rules and rescue."""
