"""Backend adapters, one package each: fsdp/ (torch FSDP2 and FSDP1), deepspeed/ (DeepSpeed ZeRO
0-3) and xla/ (PyTorch/XLA FSDP v1 and SPMD). Each imports its own optional dependency and nothing from
its siblings; only `parallel.registry` chooses between them, through each package's descriptor.py."""
