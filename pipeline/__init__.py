"""Ray Data / Ray Train stages of the DSpark workflow and ``run.py``, their command line."""
