"""Gated DeltaNet, the linear attention of the Qwen3.5 / Qwen3-Next hybrids,
over a flat batch of rows whose recurrent state lives in a state pool.

A layer's state per sequence is a fixed size whatever the sequence's
length: the causal convolution's last `K - 1` inputs and, per value head, a
`Dk x Dv` matrix S. Token t (key k_t, value v_t, query q_t, log decay g_t,
step size beta_t; k_t and q_t L2-normalised, q_t scaled by Dk^-1/2) does

    S  <- exp(g_t) S
    S  <- S + k_t (beta_t (v_t - S^T k_t))^T        (the delta rule)
    o_t = S^T q_t

Decode rows (one token) run that step batched over rows. A prefill chunk
runs it in blocks of `CHUNK` tokens: inside a block, with G_t the running
sum of g from the block's start and S0 the state before it, the updates
u_t = beta_t (v_t - ...) solve one unit lower-triangular system

    (I + A) u = beta (v - exp(G) K S0),  A[t, s] = beta_t exp(G_t - G_s) k_t.k_s  (s < t)

and then o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (k_s.q_t) u_s,
S_end = exp(G_last) S0 + sum_s exp(G_last - G_s) k_s u_s^T: a few matrix
products per block instead of a loop over its tokens. Everything runs in
float32. Each row reads the state its slot holds (zero for a row with no
computed tokens) and leaves the state after its last token there, so that
chunked prefill and decode continue it. The pool may hold the recurrent
matrices in bfloat16 (`mamba_ssm_cache_dtype`): a row widens its state as
it reads it and rounds it once, as it writes it back at the step's end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ferrox._native import gated_delta_decode_cpu
from ferrox.layers.attention.base import AttentionMetadata
from ferrox.layers.native import kernel_threads, on_cpu_fp32, state_array

# Tokens per block of the chunked form.
CHUNK = 64


@dataclass(frozen=True)
class StateRows:
    """A step's rows as the linear-attention layers read them: each row's
    first token, end, whether it starts from zero, and its slot (host
    lists, and arrays for the native step's decode rows); the slots on the
    device."""

    starts: list[int]
    ends: list[int]
    fresh: list[bool]
    slot_list: list[int]
    slots: torch.Tensor
    decode_slots: np.ndarray
    decode_fresh: np.ndarray


def state_rows(meta: AttentionMetadata) -> StateRows:
    """The step's `StateRows`, derived once and kept on the metadata (every
    linear layer of the step reads the same)."""
    if isinstance(meta._state_rows, StateRows):
        return meta._state_rows
    assert meta.state_slots is not None and meta.state_slots_cpu is not None, (
        "a linear-attention layer needs the rows' state slots"
    )
    qsl, nd = meta.query_start_loc_cpu, meta.num_decodes
    fresh = [int(c) == 0 for c in meta.num_computed_cpu]
    slot_list = [int(s) for s in meta.state_slots_cpu]
    rows = StateRows(
        [int(v) for v in qsl[:-1]],
        [int(v) for v in qsl[1:]],
        fresh,
        slot_list,
        meta.state_slots,
        np.array(slot_list[:nd], dtype=np.int64),
        np.array(fresh[:nd], dtype=np.bool_),
    )
    meta._state_rows = rows
    return rows


def _held(states: torch.Tensor, slots: torch.Tensor, fresh: list[bool]) -> torch.Tensor:
    """The states the slots hold, zero for rows that start afresh (whatever
    the slot holds: a finished sequence's state, or anything)."""
    held = states[slots]
    if any(fresh):
        start = torch.tensor(fresh, device=held.device).view(-1, *[1] * (held.dim() - 1))
        held = torch.where(start, torch.zeros((), dtype=held.dtype, device=held.device), held)
    return held


def causal_conv1d(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    states: torch.Tensor,  # [S, C, K - 1]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, C]
    """The depthwise causal convolution of each row's tokens after the
    inputs its slot holds, then SiLU; each slot keeps its row's last K - 1
    inputs."""
    r = state_rows(meta)
    slots, slot_list, starts, ends, fresh = r.slots, r.slot_list, r.starts, r.ends, r.fresh
    out = torch.empty_like(x, dtype=torch.float32)
    nd = meta.num_decodes
    x32 = x.float()
    if nd:
        held = _held(states, slots[:nd], fresh[:nd])  # [B, C, K - 1]
        window = torch.cat((held, x32[:nd, :, None]), dim=2)  # [B, C, K]
        out[:nd] = (window * weight).sum(dim=2)
        states[slots[:nd]] = window[:, :, 1:]
    k = weight.shape[1]
    for row in range(nd, meta.num_reqs):
        s, e, slot = starts[row], ends[row], slot_list[row]
        held = x32.new_zeros(x.shape[1], k - 1) if fresh[row] else states[slot]
        seq = torch.cat((held, x32[s:e].T), dim=1)  # [C, K - 1 + L]
        out[s:e] = F.conv1d(seq[None], weight[:, None, :], groups=x.shape[1])[0].T
        states[slot] = seq[:, seq.shape[1] - (k - 1) :]
    return F.silu(out).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [T, Hv]
    states: torch.Tensor,  # [S, Hv, Dk, Dv]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, Hv, Dv] float32
    """The gated delta rule over each row, from the state its slot holds;
    each slot keeps the state after its row's last token. Each query/key
    head serves Hv / Hk consecutive value heads."""
    groups = v.shape[1] // q.shape[1]
    q = _l2norm(q.float()).repeat_interleave(groups, dim=1) * q.shape[-1] ** -0.5
    k = _l2norm(k.float()).repeat_interleave(groups, dim=1)
    v, g, beta = v.float(), g.float(), beta.float()
    r = state_rows(meta)
    slots, slot_list, starts, ends, fresh = r.slots, r.slot_list, r.starts, r.ends, r.fresh
    out = torch.empty_like(v)
    nd = meta.num_decodes
    native_pool = states.device.type == "cpu" and states.dtype in (torch.float32, torch.bfloat16)
    if nd and native_pool and on_cpu_fp32(q, k, v, g, beta):
        # The native step, in place on the pool (ferrox_cpu::gated_delta).
        rows = out[:nd]
        gated_delta_decode_cpu(
            state_array(states),
            r.decode_slots,
            r.decode_fresh,
            q[:nd].contiguous().numpy(),
            k[:nd].contiguous().numpy(),
            v[:nd].contiguous().numpy(),
            g[:nd].contiguous().numpy(),
            beta[:nd].contiguous().numpy(),
            rows.numpy(),
            kernel_threads(),
        )
    elif nd:
        state = _held(states, slots[:nd], fresh[:nd]).float()  # [B, H, Dk, Dv], a copy
        heads, dk, dv = state.shape[1:]
        state.mul_(g[:nd].exp()[:, :, None, None])
        flat = state.view(nd * heads, dk, dv)  # one matrix per (row, head)
        kt = k[:nd].reshape(nd * heads, 1, dk)
        remembered = torch.bmm(kt, flat)  # [B H, 1, Dv]: S^T k
        delta = (v[:nd].reshape(nd * heads, 1, dv) - remembered) * beta[:nd].reshape(-1, 1, 1)
        flat.baddbmm_(kt.transpose(1, 2), delta)  # S += k delta^T
        out[:nd] = torch.bmm(q[:nd].reshape(nd * heads, 1, dk), flat).view(nd, heads, dv)
        states[slots[:nd]] = state.to(states.dtype)
    for row in range(nd, meta.num_reqs):
        s, e, slot = starts[row], ends[row], slot_list[row]
        held = states[slot]
        state = held.new_zeros(held.shape, dtype=torch.float32) if fresh[row] else held.float()
        for c in range(s, e, CHUNK):
            ce = min(c + CHUNK, e)
            out[c:ce], state = _chunk(q[c:ce], k[c:ce], v[c:ce], g[c:ce], beta[c:ce], state)
        states[slot] = state.to(states.dtype)
    return out


def _chunk(
    q: torch.Tensor,  # [L, H, Dk]
    k: torch.Tensor,
    v: torch.Tensor,  # [L, H, Dv]
    g: torch.Tensor,  # [L, H]
    beta: torch.Tensor,  # [L, H]
    state: torch.Tensor,  # [H, Dk, Dv]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of the chunked form (see the module's docstring): its
    outputs [L, H, Dv] and the state after it."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, L, D]
    g, beta = g.T, beta.T  # [H, L]
    n = q.shape[1]
    cum = g.cumsum(dim=1)  # G_t
    below = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp)
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~below, float("-inf")).exp()
    strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
    a = beta[:, :, None] * (k @ k.transpose(1, 2)) * strict
    eye = torch.eye(n, device=q.device).expand_as(a)
    rhs = beta[:, :, None] * (v - cum.exp()[:, :, None] * (k @ state))
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    scores = (q @ k.transpose(1, 2)) * decay  # (k_s . q_t) exp(G_t - G_s), s <= t
    out = cum.exp()[:, :, None] * (q @ state) + scores @ u
    tail = (cum[:, -1:] - cum).exp()  # exp(G_last - G_s)
    state = cum[:, -1].exp()[:, None, None] * state + (k * tail[:, :, None]).transpose(1, 2) @ u
    return out.transpose(0, 1), state


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of each head's output, scaled by `weight` and by SiLU(gate)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * normed.to(x.dtype)).float() * F.silu(gate.float())).to(x.dtype)
