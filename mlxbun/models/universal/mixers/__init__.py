"""Recurrent mixers of the universal graph: one module per kind, each with its own knobs."""
