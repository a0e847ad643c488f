"""`target_prompt_logprobs` and `prompt_alt_tokens_k` (tinker `SampleRequest`): checking
the request's tensor and computing both from a prompt's logits (pure functions, no model).

Row i of either belongs to prompt position i + 1 (scored from the logits after
prompt[:i + 1]); position 0 has no preceding context. A sparse CSR request tensor is never
densified: only its listed cells are scored, and the response keeps its layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tinker import types

from ember.errors import UserError
from ember.sampling import rng
from ember.sampling.prompt_logits import PromptLogits

# The most draws per prompt position `prompt_alt_tokens_k` may ask for (draws are with
# replacement, so a k above the vocabulary is meaningful; above this it is refused).
MAX_PROMPT_ALT_TOKENS_K = 1024
_ALT_SALT = 0xA17_70C3_5EED  # separates the alt draws' random stream from the samples'


@dataclass(frozen=True)
class PromptTargets:
    """A checked `target_prompt_logprobs`: cell m asks for logp(tokens[m]) at row rows[m]
    (-1 = nothing asked); `crow`/`col` keep a sparse request's layout (None = dense)."""

    shape: tuple[int, int]
    rows: np.ndarray  # int64 [M]
    tokens: np.ndarray  # int64 [M]
    crow: tuple[int, ...] | None = None
    col: tuple[int, ...] | None = None

    def response(self, values: np.ndarray) -> types.TensorData:
        """float32 logprobs in the request's shape and layout."""
        values = np.asarray(values, np.float32)
        if self.crow is None:
            return types.TensorData(data=values.reshape(self.shape), dtype="float32", shape=list(self.shape))
        return types.TensorData(data=values, dtype="float32", shape=list(self.shape),
                                sparse_crow_indices=list(self.crow), sparse_col_indices=list(self.col))


def _fail(field: str, expected: str, got) -> UserError:
    return UserError(f"sample request: {field}: expected {expected}, got {got!r}")


def check_alt_tokens_k(k) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_PROMPT_ALT_TOKENS_K:
        raise _fail("prompt_alt_tokens_k", f"an integer in [0, {MAX_PROMPT_ALT_TOKENS_K}]", k)
    return k


def check_targets(td, prompt_len: int, vocab_size: int) -> PromptTargets | None:
    """Validate `target_prompt_logprobs` against the prompt and the vocabulary."""
    if td is None:
        return None
    name = "target_prompt_logprobs"
    if not isinstance(td, types.TensorData):
        raise _fail(name, "a tinker.types.TensorData", type(td).__name__)
    if td.dtype != "int64":
        raise _fail(f"{name}.dtype", "'int64' (token ids)", td.dtype)
    shape = td.shape
    rows = prompt_len - 1
    if shape is None or len(shape) != 2 or shape[0] != rows or shape[1] < 1:
        raise _fail(f"{name}.shape", f"[len(prompt) - 1, K] = [{rows}, K >= 1]", shape)
    values = np.asarray(td.data, dtype=np.int64).reshape(-1)
    if td.sparse_crow_indices is None:
        if values.size != rows * shape[1]:
            raise _fail(f"{name}.data", f"{rows * shape[1]} values for shape {list(shape)}", f"{values.size} values")
        row_of, crow, col = np.repeat(np.arange(rows), shape[1]), None, None
    else:
        row_of = _check_csr(td, rows, int(shape[1]), values.size)
        crow, col = tuple(int(c) for c in td.sparse_crow_indices), tuple(int(c) for c in td.sparse_col_indices)
    bad = np.flatnonzero((values != -1) & ((values < 0) | (values >= vocab_size)))
    if bad.size:
        raise _fail(f"{name} value {int(bad[0])}", f"-1 or a token id in [0, {vocab_size})", int(values[bad[0]]))
    return PromptTargets((rows, int(shape[1])), row_of.astype(np.int64), values, crow, col)


def _check_csr(td, rows: int, cols: int, nnz: int) -> np.ndarray:
    """Checks a CSR layout (sorted, unique columns per row); returns each value's row."""
    name = "target_prompt_logprobs"
    crow = np.asarray(td.sparse_crow_indices, dtype=np.int64)
    col = np.asarray(td.sparse_col_indices if td.sparse_col_indices is not None else [], dtype=np.int64)
    if crow.shape != (rows + 1,) or crow[0] != 0 or (np.diff(crow) < 0).any() or crow[-1] != nnz:
        raise _fail(f"{name}.sparse_crow_indices", f"{rows + 1} non-decreasing offsets from 0 to {nnz}",
                    f"{crow.size} offsets ending at {int(crow[-1]) if crow.size else None}")
    if col.size != nnz or (col.size and ((col < 0).any() or (col >= cols).any())):
        raise _fail(f"{name}.sparse_col_indices", f"{nnz} column indices in [0, {cols})", f"{col.size} indices")
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    same_row = row_of[1:] == row_of[:-1]
    if (same_row & (np.diff(col) <= 0)).any():
        raise _fail(f"{name}.sparse_col_indices", "strictly increasing columns within each row", "unsorted or repeated")
    return row_of


ROW_CHUNK = 512  # prompt positions whose [rows, V] distributions are held at once


def compute(logits: torch.Tensor | PromptLogits, targets: PromptTargets | None, k: int, temperature: float,
            seed: int, chunk_rows: int = ROW_CHUNK):
    """(target logprobs TensorData | None, PromptAltTokens | None) from the logits [P - 1, V]
    of the prompt's positions after the first (held, or computed from hidden states:
    `PromptLogits`), `chunk_rows` rows (a hidden source: its own chunk) at a time (bounded memory)."""
    source = PromptLogits.of(logits)
    rows, step = len(source), source.step(chunk_rows)
    values = np.zeros(targets.tokens.size, np.float32) if targets is not None else None
    ids, lps = [], []
    for start in range(0, max(rows, 1), step):
        chunk = source.rows(start, min(start + step, rows))
        logp = torch.log_softmax(chunk.float(), dim=-1)
        if targets is not None:
            _target_logprobs(logp, targets, start, values)
        if k > 0:
            i, lp = _alt_draws(chunk, logp, k, temperature, seed, start)
            ids.append(i)
            lps.append(lp)
    alt = None
    if k > 0:
        shape = [rows, k]
        alt = types.PromptAltTokens(
            tokens=types.TensorData(data=np.concatenate(ids).astype(np.int64), dtype="int64", shape=shape),
            logprobs=types.TensorData(data=np.concatenate(lps).astype(np.float32), dtype="float32", shape=shape),
        )
    return (targets.response(values) if targets is not None else None), alt


def _target_logprobs(logp: torch.Tensor, targets: PromptTargets, start: int, out: np.ndarray) -> None:
    """Fill `out` (float32 [M], 0.0 where -1) for the cells of rows [start, start + len(logp))."""
    want = (targets.tokens >= 0) & (targets.rows >= start) & (targets.rows < start + logp.shape[0])
    if want.any():
        r = torch.as_tensor(targets.rows[want] - start, device=logp.device)
        t = torch.as_tensor(targets.tokens[want], device=logp.device)
        out[want] = logp[r, t].float().cpu().numpy()


def _alt_draws(logits, logp, k: int, temperature: float, seed: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """k draws with replacement per row from softmax(logits / temperature) (argmax at 0),
    by inverse CDF on counter-based uniforms keyed by (seed, global row, draw): the same
    seed draws the same tokens on any device and any chunking; with their raw logprobs."""
    rows = logits.shape[0]
    if temperature == 0.0:
        ids = logits.argmax(-1, keepdim=True).expand(rows, k)
    else:
        cdf = torch.softmax(logits.float() / temperature, dim=-1).double().cumsum_(-1)
        base = rng.splitmix64(np.array([seed ^ _ALT_SALT], dtype=np.uint64))
        keys = rng.splitmix64(base + np.arange(start * k, (start + rows) * k, dtype=np.uint64))
        u = torch.as_tensor(rng.uniforms(keys, np.zeros(rows * k, np.uint64)), device=logits.device).view(rows, k)
        ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=logits.shape[-1] - 1)
    return ids.cpu().numpy(), logp.gather(1, ids).float().cpu().numpy()
