"""The training-strategy spec: the model (model.py, sections.py), what each backend supports
(capabilities.py), reading / overriding / errors (io.py), the README reference (doc.py)."""
