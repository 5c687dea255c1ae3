"""What a checkpoint holds beyond the backend's model and optimizer: checkpointing.py (save, load,
periodic saves, save_pretrained; pretrained.py: its two ways to the Hugging Face files), resuming.py
(what resume() decides and says), user_state.py (the user's own registered objects) and
shared_dir.py (checkpoint.dir, one directory for every rank: checked at start-up)."""
