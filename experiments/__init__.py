"""Experiments: the studies that reproduce the source papers' effects at CPU scale (``fidelity.py``)."""
