"""The training-strategy spec: its fields and rules (model.py, sections.py, precision.py, compiling.py,
tracking.py, sequence.py, pipeline.py), the parallel dimensions (dims.py), errors every layer raises
(errors.py), reading / overriding / dumping (io.py: validated by the class the registry assembles with
every backend's section), the reference in docs/spec.md (doc.py)."""
