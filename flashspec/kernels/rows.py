"""What a launch's rows and a vocab tile's columns stand for, in every kernel.

Row r of a launch reads parameter row r // ROWS_PER_PARAM (verification flattens ``[B, G+1]``
positions into rows); column c of vocab tile pid_v holds token `_column_tokens(c, pid_v)`.
"""

import triton
import triton.language as tl


@triton.jit
def _row_params(do_sample_ptr, temperature_ptr, rows, ROWS_PER_PARAM):
    """Sampled flag and effective temperature of (in-bounds) rows: the temperature rounded
    to fp32 as transformers rounds it, 1 for greedy rows."""
    param_rows = rows // ROWS_PER_PARAM
    do_sample = tl.load(do_sample_ptr + param_rows) != 0
    temperature = tl.load(temperature_ptr + param_rows).to(tl.float32)
    sampled = do_sample & (temperature != 0.0)
    return sampled, tl.where(sampled, temperature, 1.0)


@triton.jit
def _row_noise_keys(seed_ptr, position_ptr, rows, ROWS_PER_PARAM):
    """Seed and sequence position of (in-bounds) rows: row r is position j = r % ROWS_PER_PARAM
    of batch row r // ROWS_PER_PARAM (verification flattens [B, G+1] this way)."""
    param_rows = rows // ROWS_PER_PARAM
    seed = tl.load(seed_ptr + param_rows)
    position = tl.load(position_ptr + param_rows) + rows % ROWS_PER_PARAM
    return seed, position


@triton.jit
def _row_drafts(draft_ptr, rows, ok, ROWS_PER_PARAM):
    """Drafted token id of each row (int32, -1 for none): row r is position
    j = r % ROWS_PER_PARAM of batch row b = r // ROWS_PER_PARAM, which verifies draft
    ``draft_tokens[b, j]`` (``[B, G]`` contiguous, G = ROWS_PER_PARAM - 1); the last
    position has none."""
    num_drafts = ROWS_PER_PARAM - 1
    j = rows % ROWS_PER_PARAM
    has = ok & (j < num_drafts)
    return tl.load(draft_ptr + (rows // ROWS_PER_PARAM) * num_drafts + j, mask=has,
                   other=-1).to(tl.int32)


@triton.jit
def _column_tokens(columns, pid_v, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Token ids of columns of vocab tile `pid_v`. Contiguous tiles hold tokens
    [pid_v * BLOCK_V, (pid_v + 1) * BLOCK_V). Interleaved tiles hold every NUM_VT-th group of
    16 tokens, groups pid_v, pid_v + NUM_VT, ...: tokenizers give neighbouring ids to
    related, frequent tokens, so a truncated support often crowds one contiguous tile past
    its candidate budget, and spreading groups over tiles keeps it within budget. Ids grow
    with the column either way, so argmax ties still go to the lower id."""
    if INTERLEAVE:
        return ((columns // 16) * NUM_VT + pid_v) * 16 + columns % 16
    return pid_v * BLOCK_V + columns


@triton.jit
def _token_tile(tokens, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The vocab tile that holds each token (inverse of `_column_tokens`)."""
    if INTERLEAVE:
        return (tokens // 16) % NUM_VT
    return tokens // BLOCK_V


@triton.jit
def _draft_here(draft, pid_v, NUM_VT, BLOCK_V: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Per row, whether vocab tile `pid_v` holds its drafted token (-1: none)."""
    return (draft >= 0) & (_token_tile(draft, NUM_VT, BLOCK_V, INTERLEAVE) == pid_v)
