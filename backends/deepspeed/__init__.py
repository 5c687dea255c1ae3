"""DeepSpeed ZeRO 0-3: the spec becomes a DeepSpeed config, then `deepspeed.initialize` drives training.

descriptor.py: everything the rest of polyshard knows about this backend; options.py: its section of
the spec (`deepspeed:`); translate.py: the spec as a DeepSpeed config (plain data, no deepspeed
import); engine.py: the engine, composed from parallelize.py's steps; autotp.py: `topology.tp` as
AutoTP's plan (autotp_split.py: what it did to a model); state.py and fragments.py: its checkpoint
state (fragments.py: a rank's ZeRO ranges in
place); plan.py: memory and communication model; schema.py, interop.py, import_zero.py,
import_tp.py, accelerate.py, exports.py: DeepSpeed's own rules and its files in and out;
native_checkpoint.py: DeepSpeed checkpoints in (stream_import.py: a ZeRO checkpoint one rank's file at a
time); universal.py: DeepSpeed universal checkpoints out;
pipe.py: `topology.pp` through DeepSpeed's pipeline engine (pipe_config.py: what it runs, refuses and
why, as plain data); ops.py: its just-in-time ops (built ahead, first builds said, a killed build's lock refused);
library.py: deepspeed imported without what only features polyshard never runs import (mlflow,
inductor's compiler).
"""
