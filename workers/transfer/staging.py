"""Staging for a fragmented NIXL transfer: the bookkeeping (integers only, no torch).

A request whose paired runs are many and short goes through one contiguous staging range on each side
instead of one NIXL descriptor per run and layer: the sender gathers its blocks (block_copy.gather) into its
range, writes the range with a descriptor per group of layers into the range the receiver granted, and the
receiver scatters each group into its reserved blocks (block_copy.scatter) when that write's notification
comes; nixl.py and nixl_staging.py do the moving, this module the arithmetic both sides agree on.

    stages(runs, block_bytes, mem)    whether a request of these paired runs (its pool in mem: "VRAM" or "DRAM")
                                      goes through staging
    region_bytes(cfg_gb, pool_bytes)  a side's staging region: --kv-staging-gb, or the default
    Space(nbytes)                     a staging region's bytes, handed out as aligned contiguous ranges
      .take(nbytes) -> offset | None    a free range (the smallest extent that holds it), or None: no room now
                                        (run by run then)
      .give(offset)                     that range free again;  .free_bytes, .held
    groups(layers, per_write)         the layers handed over, cut into staged writes of consecutive layers;
                                      per_write: layers_per_write(layer_bytes), about WRITE_BYTES of them (layer
                                      mode hands its layers over one at a time: a write each)
    grant_refusal(offset, nbytes, region, need)   sender: why a receiver's StagingGrant cannot be used, or None
    note_layers(grant_offset, grant_bytes, offset, nbytes, layer_bytes, seen)
                                      receiver: the layers (first, count) a StagedNote names, or why it is refused

A request's range holds its blocks layer-major in the order of its block lists: [layers, blocks, 2,
block_size, heads, dim], layer l at l * layer_bytes (layer_bytes: one layer of the request, its blocks x the
block's bytes), so any span of consecutive layers is one contiguous range: one descriptor, one note.

When staging pays (the per-run cost against the copies it adds), per memory type (STAGE_RUN_BYTES):
    VRAM   each extra descriptor costs ~6-8 us on the H200 (NIXL-NOTES, cuda_ipc between two processes);
           staging adds a gather and a scatter of the request's bytes at the device's copy rate (~2 TB/s
           there: ~1 ps a byte for the pair). It pays once a run of one layer is shorter than a few MB on
           average. Between hosts the link is slower than either copy and the gather and scatter overlap
           with other groups' writes, so it pays more.
    DRAM   on this project's 2-core CPU machine (UCX cma) an extra descriptor cost ~1-2 us, and the staged
           path added ~0.25 ns a byte (the index ops and their fixed costs: tiny model, 2 MiB in 70 runs of
           ~15 KB, 1.22 ms staged against 0.87 ms run by run and 0.72 ms contiguous). It pays only for
           runs of a few KB: one block of a small pool.
and only where the runs are more than a few (STAGE_RUNS: a request of 2-4 runs keeps its few direct
descriptors and holds no staging space).

Nothing a peer sends is trusted: the sender checks the grant against the staging region the handshake
named and against the bytes it needs; the receiver checks every note against its grant (inside, whole
layers, no layer twice) before any scatter reads staging or writes a block.
"""

from __future__ import annotations

from pdserve.workers.engine.block_pool import BlockPool

STAGE_RUNS = 4  # more runs than this ...
STAGE_RUN_BYTES = {"VRAM": 4 * 2**20, "DRAM": 4 * 2**10}  # ... shorter than this on average (a run of one layer)
WRITE_BYTES = 256 * 2**20  # bulk: layers per staged write, about this many bytes (gathers overlap writes)
DEFAULT_MAX_BYTES = 2 * 2**30  # default region: half the pool, at most this (a 32k qwen2.5-7b request: 1.75 GiB)
ALIGN = 256  # every range starts on this (the views as 8-byte words; GPU kernels' aligned loads)


def stages(runs, block_bytes: int, mem_type: str) -> bool:
    """Whether a request of these paired runs (src_start, dst_start, length) goes through staging, its pool in
    mem_type ("VRAM" or "DRAM")."""
    if len(runs) <= STAGE_RUNS:
        return False
    blocks = sum(n for _, _, n in runs)
    return blocks * block_bytes < STAGE_RUN_BYTES[mem_type] * len(runs)


def region_bytes(cfg_gb: float | None, pool_bytes: int) -> int:
    """A side's staging region: cfg_gb GiB (--kv-staging-gb; 0: none), else half its pool, at most
    DEFAULT_MAX_BYTES; a multiple of ALIGN."""
    nbytes = int(cfg_gb * 2**30) if cfg_gb is not None else min(pool_bytes // 2, DEFAULT_MAX_BYTES)
    return nbytes - nbytes % ALIGN


class Space:
    """A staging region's bytes (one side, its I/O thread only), handed out in contiguous ranges of whole ALIGN
    units: the KV pool's own extent bookkeeping (block_pool.BlockPool, a unit for a block), plus the size of
    each range handed out."""

    def __init__(self, nbytes: int):
        if nbytes < 0 or nbytes % ALIGN:
            raise ValueError(f"a staging region is a multiple of {ALIGN} bytes, got {nbytes}")
        self.nbytes = nbytes
        self._units = BlockPool(nbytes // ALIGN) if nbytes else None
        self._taken: dict[int, int] = {}  # offset -> units

    @property
    def free_bytes(self) -> int:
        return self._units.num_free * ALIGN if self._units else 0

    @property
    def held(self) -> int:
        """Ranges handed out and not given back."""
        return len(self._taken)

    def take(self, nbytes: int) -> int | None:
        """The offset of a free range of nbytes (rounded up to ALIGN), from the smallest free extent that holds
        it; None if none is that long."""
        if nbytes <= 0:
            raise ValueError(f"a staging range needs a positive size, got {nbytes}")
        units = -(-nbytes // ALIGN)
        start = self._units.take_range(units) if self._units else None
        if start is None:
            return None
        self._taken[start * ALIGN] = units
        return start * ALIGN

    def give(self, offset: int) -> None:
        """The range take() returned at offset is free again (merged with its free neighbours)."""
        units = self._taken.pop(offset)  # KeyError: not a range of this space (a bug)
        self._units.free_range(offset // ALIGN, units)


def groups(layers: list[int], per_write: int) -> list[tuple[int, int]]:
    """(first, count) per staged write: the layers handed over in spans of consecutive ones, each cut into
    writes of at most per_write layers."""
    out: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if out and out[-1][0] + out[-1][1] == layer and out[-1][1] < per_write:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((layer, 1))
    return out


def layers_per_write(layer_bytes: int) -> int:
    """Bulk: layers one staged write carries (WRITE_BYTES of them, at least one)."""
    return max(1, WRITE_BYTES // layer_bytes)


def grant_refusal(offset: int, nbytes: int, region: int, need: int) -> str | None:
    """Sender: why bytes offset..offset+nbytes-1 of a staging region of `region` bytes cannot hold a request
    of `need` bytes, or None."""
    if nbytes != need:
        return f"a grant of {nbytes} bytes for a request of {need}"
    if offset % 8:
        return f"a grant at offset {offset}, not on an 8-byte boundary"
    if offset + nbytes > region:
        return f"bytes {offset}..{offset + nbytes - 1} granted in a staging region of {region} bytes"
    return None


def note_layers(grant_offset: int, grant_bytes: int, offset: int, nbytes: int, layer_bytes: int,
                seen: set[int]) -> tuple[int, int] | str:
    """Receiver: the layers (first, count) a staged write of bytes offset..offset+nbytes-1 of the staging region
    holds, for a grant of grant_bytes at grant_offset over layers of layer_bytes each; or why it is refused:
    outside the grant, not whole layers, or a layer already written (seen: layers scattered so far)."""
    if nbytes <= 0 or offset < grant_offset or offset + nbytes > grant_offset + grant_bytes:
        return (f"bytes {offset}..{offset + nbytes - 1} of the staging region, outside its grant "
                f"{grant_offset}..{grant_offset + grant_bytes - 1}")
    if (offset - grant_offset) % layer_bytes or nbytes % layer_bytes:
        return f"bytes {offset}..{offset + nbytes - 1}: not whole layers of {layer_bytes} bytes"
    first, count = (offset - grant_offset) // layer_bytes, nbytes // layer_bytes
    again = seen.intersection(range(first, first + count))
    if again:
        return f"layer {min(again)} written twice"
    return first, count
