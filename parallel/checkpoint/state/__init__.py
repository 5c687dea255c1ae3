"""The portable state: portable.py (the nested state every backend writes and reads through DCP),
sink.py (one save's files: every writer of a save records what it wrote through it), optim_state.py
(optimizer state by parameter name), state_files.py (its files written, hashed and sent to the
disk), chunks.py (a rank's ranges of a tensor as blocks of the whole), dcp_state.py (modules torch's
get_state_dict understands: FSDP1, FSDP2, plain), streamed.py (a state written by several writers
from one process, one part in memory at a time)."""
