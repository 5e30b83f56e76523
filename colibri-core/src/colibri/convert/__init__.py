"""Quantized expert containers: ``coli convert`` and the reader engines and doctor rely on.

Modules (imported on demand; numpy is needed by all but ``spec``):

* ``schemes``   — int8-row / int4-g64 quantization, the exact definition of the stored bits.
* ``fast_quant`` — the same bits on cache-sized row blocks: what the converter runs (tests hold it to ``schemes``).
* ``container`` — the format's stamp, naming rules, and ``open_container`` (reader + validator).
* ``plan``      — every output byte decided from headers: shards, order, dtypes.
* ``io``        — bounded-memory row-chunk reading and writing.
* ``run``       — the resumable conversion itself.
* ``verify``    — ``--verify``: every tensor checked against its source.
* ``spec``      — core's default ``converter_spec`` (from ``tensor_layout``).
* ``quality``   — teacher-forced comparison of a container against its source through the engine protocol.

The format is specified in docs/formats.md.
"""
