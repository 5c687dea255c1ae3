"""DeepSpeed's checkpoint state: state.py (ZeRO's flat partitions and per-parameter masters to and
from the portable format), fragments.py (a rank's ZeRO ranges saved and loaded in place, O(model /
N)), native_checkpoint.py (DeepSpeed checkpoints in; stream_import.py: a ZeRO checkpoint one rank's
file at a time), universal.py (DeepSpeed universal checkpoints out)."""
