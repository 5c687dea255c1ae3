"""What a checkpoint directory is: directory.py (atomic directories, `latest`, keep_last, what is
ours to replace), manifest.py (what a complete checkpoint is, its digests and their verification),
safe.py (every file from elsewhere read as data: no link followed, sizes checked, pickles through
torch's weights_only), tensor_items.py (DCP's items unpickled once per distinct pickle, as data),
contents.py (the one reader of a checkpoint's small files), schemas.py (their schemas),
tokenizer.py (a tokenizer's files copied as data)."""
