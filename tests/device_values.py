"""Values only the device sees: slots outside the pool, seq_len < 1, plan rows that do not fit.

The host cannot check these without a sync, so the kernels skip the row
(``docs/RELIABILITY.md``). This module states the skip rule in Python
(:func:`decode_keeps`, :func:`plan_row_keeps`, a line-by-line restatement of
``c128_decode_kernel`` in ``c128_decode.cuh`` and ``decode_segment`` in ``c128_prefill.cuh``),
builds calls that mix good rows with bad ones, and checks a run of such a
call against the reference run on the good rows alone. Everything here is
host tensors; run the kernels through ``tests/device_runner.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import oracle
from flash_compress import reference as ref
from flash_compress.plan_rows import CHUNK_SIZE, PADDING_BYTE, PADDING_ROW, ROW_BYTES, decode_rows, encode_rows

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

__all__ = [
    "DecodeCall",
    "PrefillCall",
    "bad_decode_call",
    "bad_prefill_call",
    "check_against_reference",
    "decode_keeps",
    "long_padded_call",
    "plan_row_keeps",
    "random_bytes_call",
    "spoilt_row_count",
]


def bad_slots(num_slots: int) -> list[int]:
    """Slot values outside ``[0, num_slots)``, extremes included."""
    return [-1, num_slots, num_slots + 7, INT32_MAX, INT32_MIN]


def decode_keeps(slot: int, seq_len: int, num_slots: int) -> bool:
    """Whether ``c128_decode_kernel`` runs a request (it skips the rest)."""
    return seq_len >= 1 and 0 <= slot < num_slots


def plan_row_keeps(row, write_pass: bool, num_tokens: int, indices, load_indices, num_slots: int) -> bool:
    """Whether ``decode_segment`` lets a prefill pass run plan row ``(ragged_id, batch_id, position, window_len)``."""
    ragged, batch, position, window = (int(v) for v in row)
    if ragged == PADDING_ROW:
        return False
    last_pos = position % CHUNK_SIZE
    if (last_pos == CHUNK_SIZE - 1) == write_pass:  # a row of the other pass
        return False
    if window == 0 or window > last_pos + 1:
        return False
    if ragged >= num_tokens or ragged + 1 < window:
        return False
    if batch >= len(indices):
        return False
    if last_pos + 1 - window != 0 and not 0 <= int(load_indices[batch]) < num_slots:
        return False
    if write_pass and not 0 <= int(indices[batch]) < num_slots:
        return False
    return True


# ---------------------------------------------------------------------------
# Calls mixing good and bad rows.
# ---------------------------------------------------------------------------


@dataclass
class DecodeCall:
    buffer: torch.Tensor  # [S, 1, 3D], random (so a missed skip changes it)
    inputs: torch.Tensor
    output: torch.Tensor  # NaN-poisoned
    ape: torch.Tensor
    indices: torch.Tensor
    seq_lens: torch.Tensor

    def args(self) -> tuple:
        return (self.buffer, self.inputs, self.output, self.ape, self.indices, self.seq_lens, None)


@dataclass
class PrefillCall:
    buffer: torch.Tensor
    inputs: torch.Tensor
    output: torch.Tensor
    ape: torch.Tensor
    indices: torch.Tensor
    compress_plan: torch.Tensor
    write_plan: torch.Tensor
    load_indices: torch.Tensor

    def args(self) -> tuple:
        return (self.buffer, self.inputs, self.output, self.ape, self.indices, self.compress_plan, self.write_plan,
                self.load_indices)


def plausible_states(gen: torch.Generator, num_slots: int, head_dim: int) -> torch.Tensor:
    """Finite random states with a positive sum, so a merge with them is well defined."""
    buf = torch.randn(num_slots, 1, 3 * head_dim, generator=gen)
    buf[:, 0, head_dim : 2 * head_dim] = buf[:, 0, head_dim : 2 * head_dim].abs() + 0.5
    return buf


def _as_i32(values) -> torch.Tensor:
    return values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int32)


def _float_tensors(gen: torch.Generator, num_slots: int, head_dim: int, rows: int) -> dict[str, torch.Tensor]:
    """Random states and tokens, a NaN-poisoned output, a random ape."""
    return {
        "buffer": plausible_states(gen, num_slots, head_dim),
        "inputs": torch.randn(rows, 2 * head_dim, generator=gen),
        "output": torch.full((rows, head_dim), float("nan")),
        "ape": torch.randn(CHUNK_SIZE, head_dim, generator=gen),
    }


def _prefill_call(gen: torch.Generator, num_slots: int, head_dim: int, num_tokens: int, indices, compress_plan,
                  write_plan, load_indices) -> PrefillCall:
    return PrefillCall(**_float_tensors(gen, num_slots, head_dim, num_tokens), indices=_as_i32(indices),
                       compress_plan=compress_plan, write_plan=write_plan, load_indices=_as_i32(load_indices))


def bad_decode_call(seed: int, head_dim: int, num_slots: int = 8, batch: int = 24) -> DecodeCall:
    """About half the requests have a slot outside the pool or a seq_len < 1; good ones use distinct slots."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(num_slots))
    rng.shuffle(free)
    indices, seq_lens = [], []
    for _ in range(batch):
        # Positions 127 (would write the output), 0 (would reset) and others (would store).
        length = rng.choice([CHUNK_SIZE, 2 * CHUNK_SIZE, 1, CHUNK_SIZE + 1, rng.randint(2, 5000)])
        kind = rng.random()
        if free and kind < 0.45:
            indices.append(free.pop())
            seq_lens.append(length)
        elif kind < 0.75:
            indices.append(rng.choice(bad_slots(num_slots)))
            seq_lens.append(length)
        else:
            indices.append(rng.randrange(num_slots))
            seq_lens.append(rng.choice([0, -1, -CHUNK_SIZE, INT32_MIN]))
    return DecodeCall(**_float_tensors(gen, num_slots, head_dim, batch), indices=_as_i32(indices),
                      seq_lens=_as_i32(seq_lens))


def _spoil(row: list[int], write_pass: bool, num_tokens: int, batch: int, rng: random.Random) -> list[int]:
    """``row`` changed in one field so that the skip rule rejects it (whatever the slots)."""
    ragged, b, position, window = row
    last_pos = position % CHUNK_SIZE
    options = [
        lambda: [rng.choice([num_tokens, num_tokens + 5, PADDING_ROW - 1]), b, position, window],  # past the input
        lambda: [ragged, rng.choice([batch, batch + 3, PADDING_ROW - 1, PADDING_ROW]), position, window],  # past the batch
        lambda: [ragged, b, position, 0],  # empty window
        lambda: [ragged, b, position, last_pos + 2 + rng.randint(0, 1000)],  # starts before the chunk
        lambda: [PADDING_ROW, b, position, window],  # padding
        # A row of the other pass: compress rows that do not close a chunk, write rows that do.
        lambda: [ragged, b, position | (CHUNK_SIZE - 1), window] if write_pass else [ragged, b, position - 1, window],
    ]
    if window >= 2:
        options.append(lambda: [window - 2, b, position, window])  # window starts before row 0
    return rng.choice(options)()


def bad_prefill_call(seed: int, head_dim: int, num_slots: int = 16) -> PrefillCall:
    """A planned prefill where some plan rows are spoilt and some requests' slots are outside the pool."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = rng.randint(2, min(6, num_slots // 2))
    # Distinct target slots; a request loads from its own target or a spare slot that no request writes.
    slots = rng.sample(range(num_slots), 2 * batch)
    targets, loads = slots[:batch], [s if rng.random() < 0.5 else slots[batch + i] for i, s in enumerate(slots[:batch])]
    extend = [rng.choice([1, rng.randint(2, 40), rng.randint(100, 300)]) for _ in range(batch)]
    seq = [e + rng.choice([0, 5, 127, 128, rng.randint(0, 600)]) for e in extend]
    total = sum(extend)
    cp = torch.zeros(total, ROW_BYTES, dtype=torch.uint8)
    wp = torch.zeros(total, ROW_BYTES, dtype=torch.uint8)
    num_compress, num_write = ref.plan_online_prefill(torch.tensor(extend), torch.tensor(seq), cp, wp, False)
    rows = {}
    for name, plan, n, write_pass in (("compress", cp, num_compress, False), ("write", wp, num_write, True)):
        decoded = decode_rows(plan[:n]).tolist()
        decoded = [_spoil(r, write_pass, total, batch, rng) if rng.random() < 0.3 else r for r in decoded]
        # CUDA-graph padding in between and at the end, as a padded plan would have.
        for _ in range(rng.randint(0, 3)):
            decoded.insert(rng.randint(0, len(decoded)), [PADDING_ROW] * 4)
        rows[name] = decoded
    for b in range(batch):  # some requests write to / read from a slot outside the pool
        if rng.random() < 0.2:
            targets[b] = rng.choice(bad_slots(num_slots))
        if rng.random() < 0.2:
            loads[b] = rng.choice(bad_slots(num_slots))
    return _prefill_call(gen, num_slots, head_dim, total, targets, encode_rows(rows["compress"]),
                         encode_rows(rows["write"]), loads)


# ---------------------------------------------------------------------------
# The expected result: the reference on the rows the kernels keep.
# ---------------------------------------------------------------------------


def _reference_decode(call: DecodeCall) -> tuple[torch.Tensor, torch.Tensor, set[int], set[int]]:
    num_slots = call.buffer.shape[0]
    keep = [b for b in range(len(call.indices))
            if decode_keeps(int(call.indices[b]), int(call.seq_lens[b]), num_slots)]
    buffer, output = call.buffer.clone(), call.output.clone()
    if keep:
        sub_out = output[keep].clone()
        ref.run_decode(buffer, call.inputs[keep], sub_out, call.ape, call.indices[keep], call.seq_lens[keep])
        output[keep] = sub_out
    closes = {b for b in keep if (int(call.seq_lens[b]) - 1) % CHUNK_SIZE == CHUNK_SIZE - 1}
    written_slots = {int(call.indices[b]) for b in keep if b not in closes}
    return buffer, output, written_slots, closes


def _reference_prefill(call: PrefillCall) -> tuple[torch.Tensor, torch.Tensor, set[int], set[int]]:
    num_slots, num_tokens = call.buffer.shape[0], call.inputs.shape[0]
    kept = {}
    for name, plan, write_pass in (("compress", call.compress_plan, False), ("write", call.write_plan, True)):
        rows = _non_padding(plan)
        kept[name] = [r for r in rows
                      if plan_row_keeps(r, write_pass, num_tokens, call.indices, call.load_indices, num_slots)]
    # Rows that use a slot outside the pool are not kept, so any in-pool stand-in slot gives the same result.
    clamp = lambda t: torch.where((t >= 0) & (t < num_slots), t, torch.zeros_like(t))  # noqa: E731
    buffer, output = call.buffer.clone(), call.output.clone()
    ref.run_prefill(buffer, call.inputs, output, call.ape, clamp(call.indices), encode_rows(kept["compress"]),
                    encode_rows(kept["write"]), clamp(call.load_indices))
    written_slots = {int(call.indices[r[1]]) for r in kept["write"]}
    written_rows = {r[0] for r in kept["compress"]}
    return buffer, output, written_slots, written_rows


def _as_state(state: torch.Tensor) -> oracle.PartialState:
    s = state.reshape(-1).to(torch.float64)
    d = s.numel() // 3
    return oracle.PartialState(max=s[:d], sum=s[d : 2 * d], kv=s[2 * d :])


def check_against_reference(call: Any, got_buffer: torch.Tensor, got_output: torch.Tensor, what: str) -> dict:
    """The kernels' buffer and output after ``call`` (host copies) against the reference on the kept rows.

    Rows the kernels skip must leave their output row NaN and their slot
    bitwise untouched; kept rows must match the reference (oracle tolerances).
    Returns counts of what was checked.
    """
    if isinstance(call, DecodeCall):
        want_buffer, want_output, written_slots, written_rows = _reference_decode(call)
    else:
        want_buffer, want_output, written_slots, written_rows = _reference_prefill(call)
    rows = sorted(written_rows)
    untouched_rows = [r for r in range(got_output.shape[0]) if r not in written_rows]
    if rows:
        oracle.assert_rows_close(got_output[rows], want_output[rows], f"{what}: kept output rows {rows}")
    assert bool(torch.isnan(got_output[untouched_rows]).all()), f"{what}: a skipped or non-closing row was written"
    for slot in range(got_buffer.shape[0]):
        if slot in written_slots:
            oracle.assert_state_close(got_buffer[slot, 0], _as_state(want_buffer[slot, 0]), f"{what}: slot {slot}")
        else:
            assert torch.equal(got_buffer[slot].view(torch.int32), call.buffer[slot].view(torch.int32)), (
                f"{what}: slot {slot} written but no kept row targets it"
            )
    return {"rows": len(rows), "slots": len(written_slots), "skipped_rows": len(untouched_rows)}


def _non_padding(plan: torch.Tensor) -> list[list[int]]:
    """The plan's rows other than sentinel rows (which every pass skips), decoded."""
    rows = decode_rows(plan)
    return rows[rows[:, 0] != PADDING_ROW].tolist()


def spoilt_row_count(call: PrefillCall) -> int:
    """Rows of both plans the kernels skip (sentinel rows included)."""
    num_slots, num_tokens = call.buffer.shape[0], call.inputs.shape[0]
    count = 0
    for plan, write_pass in ((call.compress_plan, False), (call.write_plan, True)):
        live = _non_padding(plan)
        count += plan.shape[0] - len(live)
        count += sum(not plan_row_keeps(r, write_pass, num_tokens, call.indices, call.load_indices, num_slots)
                     for r in live)
    return count


def long_padded_call(seed: int, head_dim: int, rows: int, num_slots: int = 8) -> PrefillCall:
    """A small planned prefill whose rows sit at random places in ``rows``-row plans of padding.

    Plans may have any number of rows; ``rows`` far above the GPU's resident
    blocks x 256 makes every block of a pass loop over several batches of rows.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    extend, seq = [300, 7, 129], [300, 200, 400]
    total = sum(extend)
    cp = torch.zeros(total, ROW_BYTES, dtype=torch.uint8)
    wp = torch.zeros(total, ROW_BYTES, dtype=torch.uint8)
    num_compress, num_write = ref.plan_online_prefill(torch.tensor(extend), torch.tensor(seq), cp, wp, False)
    plans = []
    for plan, n in ((cp, num_compress), (wp, num_write)):
        padded = torch.full((rows, ROW_BYTES), PADDING_BYTE, dtype=torch.uint8)
        padded[sorted(rng.sample(range(rows), n))] = plan[:n]
        plans.append(padded)
    return _prefill_call(gen, num_slots, head_dim, total, [1, 3, 5], plans[0], plans[1], [1, 2, 5])


def random_bytes_call(seed: int, head_dim: int, num_slots: int = 6) -> PrefillCall:
    """Plans, indices and load_indices of random bytes: nothing to compare, only memory safety to check."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    tokens, batch, rows = int(rng.integers(1, 300)), int(rng.integers(1, 8)), int(rng.integers(1, 64))
    plans = []
    for _ in range(2):
        raw = rng.integers(0, 256, size=(rows, ROW_BYTES), dtype=np.uint8)
        # Half the rows with small fields, so some pass the checks and actually run.
        small = rng.random(rows) < 0.5
        fields = raw.view("<u4").reshape(rows, 4)
        fields[small] = np.stack([rng.integers(0, tokens + 2, rows), rng.integers(0, batch + 1, rows),
                                  rng.integers(0, 1024, rows), rng.integers(0, 130, rows)], axis=1)[small]
        plans.append(torch.from_numpy(raw.copy()))
    slot_values = lambda: torch.from_numpy(  # noqa: E731
        rng.choice([0, 1, num_slots - 1, num_slots, -1, INT32_MAX, INT32_MIN], size=batch).astype(np.int32))
    return _prefill_call(gen, num_slots, head_dim, tokens, slot_values(), plans[0], plans[1], slot_values())
