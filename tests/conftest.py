import os

# accelerate/transformers would pick XLA (and print a PJRT warning) when torch_xla is installed.
os.environ.setdefault("USE_TORCH_XLA", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PJRT_DEVICE", "CPU")  # the suite runs on CPU; torch_xla would guess and warn
