"""Runs out of memory for real: asks for a petabyte, dies of the MemoryError traceback (exit 1)."""

print("allocating", flush=True)
buffer = bytearray(2**50)
