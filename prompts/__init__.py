"""Versioned prompt templates (``<name>.v<N>.txt``), shipped as package data.

A template's file stem is stored with every result and in the response-cache key, so editing a
template means adding a new version, not changing an old one.
"""
