"""Checkpoints: the msgpack-sharded format every host reads partially, its writer, and converters.

format.py (index schema, validation, CheckpointError) -> writer.py (stream tensors into shards) ->
reader.py (CheckpointReader: ranged, verified, sharded loads). Converters bring foreign weights into the
format: convert_safetensors.py, convert_gguf.py, convert_easydel.py (names/layouts in layout.py), driven by
convert.py (`raydeploy convert`). demo.py resolves `demo:<name>` references to a cached conversion.
See docs/checkpoint-format.md.

Nothing heavy is imported here: host actors import submodules after setting up JAX.
"""
