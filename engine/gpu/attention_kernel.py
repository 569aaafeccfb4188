"""The Triton kernels of engine/gpu/paged_attention.py (its docstring says how
they work): imported only where Triton is installed."""

import triton.language as tl


def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    tables_ptr, q_starts_ptr, q_lens_ptr, seq_lens_ptr, splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table, scale,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    tile = tl.program_id(1) // splits
    split = tl.program_id(1) % splits
    kv_head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + seq)
    if tile * BLOCK_M < q_len:
        q_start = tl.load(q_starts_ptr + seq)
        context = tl.load(seq_lens_ptr + seq) - q_len  # tokens before this step's
        r = tl.arange(0, ROWS)
        local = r // GROUP_P
        token = tile * BLOCK_M + local
        group = r % GROUP_P
        row_ok = (local < BLOCK_M) & (token < q_len) & (group < GROUP)
        head = kv_head * GROUP + group
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_rows = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptr + q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        position = context + token  # each row's absolute position: it sees keys [0, position]
        last = context + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len)  # keys [0, last) for the tile
        chunk = tl.cdiv(tl.cdiv(last, splits), BLOCK_N) * BLOCK_N  # this split's share of them
        first = split * chunk
        end = tl.minimum(last, first + chunk)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for start in range(first, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < end
            block = tl.load(tables_ptr + seq * stride_table + n // BLOCK_SIZE, mask=n_ok, other=0)
            offset = n % BLOCK_SIZE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k_rows = block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh
            k = tl.load(k_ptr + k_rows + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, BLOCK_N]
            visible = (n[None, :] <= position[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v_rows = block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
            v = tl.load(v_ptr + v_rows + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if splits == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_rows = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
            o_mask = row_ok[:, None] & d_ok[None, :]
            tl.store(out_ptr + o_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:  # one query token (decode): rows are heads; partials by (seq, split, head)
            part = (seq * splits + split) * (GROUP * tl.num_programs(2)) + head
            acc_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :]
            tl.store(acc_ptrs, acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


def combine_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, q_starts_ptr, splits, stride_ot, stride_oh,
    SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One (sequence, head) of a decode launch whose keys were split: the
    partial softmax sums merged into the output row."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    s = tl.arange(0, SPLITS_P)
    s_ok = s < splits
    part = (seq * splits + s) * heads + head
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l_i = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)  # split 0 always has keys: finite
    weight = tl.where(s_ok, tl.exp(m - m_max), 0.0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = s_ok[:, None] & d_ok[None, :]
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_i * weight, 0)
    row = tl.load(q_starts_ptr + seq)
    o_ptrs = out_ptr + row * stride_ot + head * stride_oh + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)
