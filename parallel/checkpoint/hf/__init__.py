"""The Hugging Face export: export.py (what is exported: weights by HF name, the model's and PEFT's
configs), hf_files.py (the safetensors files and index it writes), capture.py (save_pretrained's
sink: DCP's write items kept, not written), hf_gather.py (save_pretrained's pieces written in place
by every rank, never gathered on one)."""
