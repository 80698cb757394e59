"""Chat text, pure (no torch): template families and memra's tool convention, rendering and
tokenizing, reply parsing, incremental detokenizing, the reply records and stop strings."""
