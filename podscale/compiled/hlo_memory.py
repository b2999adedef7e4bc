"""What a compiled step holds in memory per device: ``memory_analysis()`` read into a dict, and the
chip's share of it where a remat policy offloads buffers to host memory."""

from __future__ import annotations


def memory_of(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    fields = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
    }
    fields["peak"] = fields["arguments"] + fields["outputs"] + fields["temporaries"] - fields["aliased"]
    # The compiler's own peak of its buffer assignment (what is live at once; XLA:TPU checks this
    # against the chip's memory); the sum above counts every temporary as live at once.
    allocated = getattr(m, "peak_memory_in_bytes", 0)
    if allocated:
        fields["allocated"] = allocated
    host = getattr(m, "host_temp_size_in_bytes", 0)
    if host:  # buffers a remat policy offloads to host memory (pinned_host), not in the chip's HBM
        fields["host_temporaries"] = host
    return {k: int(v) for k, v in fields.items()}


def device_bytes(memory: dict[str, int]) -> int:
    """The chip memory per device of a program with :func:`memory_of`'s ``memory``: the
    compiler's peak (``allocated``, else the sum ``peak``). Where a remat policy offloads buffers
    to host memory, XLA:TPU's peak is no longer the device's: it is the arguments, the outputs and
    the host buffers, without the device's temporaries (a scanned toy on v6e at 4, 16 and 32
    layers, and Llama 3.1 70B at 5 per chip on v6e-256: so, within a few KB). There the device's buffers
    are summed instead, every temporary counted live (``peak``): an upper bound of what the chip
    holds at once."""
    if memory.get("host_temporaries"):
        return memory.get("peak", 0)
    return memory.get("allocated") or memory.get("peak", 0)
