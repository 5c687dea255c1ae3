"""Configs people already have: accelerate files in (accelerate.py), every export (export.py)."""
