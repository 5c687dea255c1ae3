"""What people look at while a job runs: tracking.py (the engine's tracker part), trackers.py (one sink
per tracking library), progress_bar.py (the training loop's bar), flops.py (FLOPs per token and device
peaks: MFU)."""
