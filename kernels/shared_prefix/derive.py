"""Find, from block tables, the batch rows that share leading runs of physical blocks.

The radix tree gives sequences with a common cached prefix the same physical block ids,
so sharing shows in the tables themselves: counting each block id over the whole batch
(one bincount) tells how many rows share each entry. An id counts as shared only if all
its occurrences sit at one column under one parent id, which by induction means its rows
agree on the whole prefix, so arbitrary tables can never produce a wrong group. Where
the count of rows sharing a row's prefix drops, a node of the sharing tree ends; the
tree is walked level by level for all rows at once. No Python loop over tokens, blocks
or rows; the work is a few dozen torch ops over the batch x blocks matrix plus arrays as
long as the largest block id in use."""

import torch

from kernels.shared_prefix.groups import PrefixGroups

_I32 = torch.int32


def _fail(name, msg):
    raise ValueError(f"{name}: {msg}")


def _as_tables(block_tables, seq_lens):
    if isinstance(block_tables, torch.Tensor):
        if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
            _fail("block_tables", f"expected a [B, max_blocks] int tensor, got "
                                  f"{tuple(block_tables.shape)} {block_tables.dtype}")
        tables = block_tables.detach().to("cpu", torch.int64)
    elif isinstance(block_tables, (list, tuple)):
        width = max((len(r) for r in block_tables), default=0)
        try:
            tables = torch.tensor([list(r) + [0] * (width - len(r)) for r in block_tables],
                                  dtype=torch.int64).view(len(block_tables), width)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"block_tables: rows must be lists of ints ({e})") from None
    else:
        _fail("block_tables", f"expected a list of lists or a tensor, got {type(block_tables).__name__}")
    if isinstance(seq_lens, torch.Tensor):
        lens = seq_lens.detach().to("cpu", torch.int64).flatten()
    else:
        try:
            lens = torch.tensor(list(seq_lens), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"seq_lens: expected ints ({e})") from None
    if lens.shape[0] != tables.shape[0]:
        _fail("seq_lens", f"{lens.shape[0]} lengths for {tables.shape[0]} block tables")
    return tables, lens


def derive_groups(block_tables, seq_lens, *, block_size, min_shared_blocks=1, max_levels=4,
                  device=None) -> PrefixGroups:
    """block_tables: list of per-sequence block id lists, or a [B, max_blocks] int tensor;
    seq_lens [B]: tokens of each sequence's context including the newest (decode) token.

    A group is made of >= 2 rows sharing a run of >= min_shared_blocks full blocks beyond
    the row's previous group (at most max_levels groups per row). Blocks holding a row's
    newest token are never shared, so every row keeps a private part. Returns CPU tensors,
    or tensors on `device` (copied without blocking)."""
    for name, v, lo in (("block_size", block_size, 1), ("min_shared_blocks", min_shared_blocks, 1),
                        ("max_levels", max_levels, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            _fail(name, f"expected an int >= {lo}, got {v!r}")
    tables, lens = _as_tables(block_tables, seq_lens)
    batch, width = tables.shape
    if batch and int(lens.min()) < 1:
        _fail("seq_lens", "every sequence needs at least one token")
    if batch and int(lens.max()) > width * block_size:
        _fail("seq_lens", f"a length exceeds the table's {width} blocks of {block_size}")
    cap = (lens - 1) // block_size  # full blocks before the one holding the newest token
    ncol = int(cap.max()) if batch else 0
    if batch < 2 or ncol < min_shared_blocks:
        return _finish(PrefixGroups.empty(batch), device)
    t = tables[:, :ncol]
    col = torch.arange(ncol)
    valid = col[None, :] < cap[:, None]
    if int(torch.where(valid, t, 0).min()) < 0:
        _fail("block_tables", "a used entry is negative")
    hi = int(torch.where(valid, t, 0).max()) + 1
    t = torch.where(valid, t, hi).flatten()  # unused entries all go to the spare id `hi`
    # A physical block sits at one depth under one parent in a radix tree: check it (a
    # parent key folds in the column) instead of trusting it, so shared means shared.
    par = torch.cat([torch.full((batch, 1), -1), t.view(batch, ncol)[:, :-1]], dim=1)
    par_key = (par * ncol + col[None, :]).flatten()
    pmin = torch.full((hi + 1,), 1 << 62).scatter_reduce(0, t, par_key, "amin")
    pmax = torch.full((hi + 1,), -(1 << 62)).scatter_reduce(0, t, par_key, "amax")
    cnt = torch.bincount(t, minlength=hi + 1)
    cnt = torch.where(pmin == pmax, cnt, 0)[t].view(batch, ncol)
    shared = valid & (cnt >= 2)
    run = torch.where(shared.all(dim=1), ncol, (~shared).to(torch.uint8).argmax(dim=1))
    rows_c = torch.where(col[None, :] < run[:, None], cnt, 0)
    nxt = torch.cat([rows_c[:, 1:], torch.zeros(batch, 1, dtype=rows_c.dtype)], dim=1)
    ends = (rows_c > 0) & (nxt < rows_c)  # a sharing-tree node ends after this column
    eb, ej = torch.nonzero(ends, as_tuple=True)  # row-major: each row's ends top-down
    return _finish(_select(eb, ej, t.view(batch, ncol)[eb, ej], tables, batch, block_size, min_shared_blocks,
                           max_levels), device)


def _select(eb, ej, node, tables, batch, block_size, min_blocks, max_levels):
    """Walk every row's node ends top-down, all rows at once; keep a node when its segment
    (from the row's last kept node) is long enough. All rows of a node share the path
    above it, so they all make the same choice and agree on its segment."""
    per_row = torch.bincount(eb, minlength=batch)
    width = int(per_row.max()) if eb.numel() else 0
    k = torch.arange(eb.shape[0]) - (torch.cumsum(per_row, 0) - per_row)[eb]
    depth = torch.full((batch, width), -(1 << 40))
    depth[eb, k] = ej + 1
    nodes = torch.zeros((batch, width), dtype=torch.long)
    nodes[eb, k] = node
    last = torch.zeros(batch, dtype=torch.long)
    levels = torch.zeros(batch, dtype=torch.long)
    keep = torch.zeros((batch, width), dtype=torch.bool)
    start = torch.zeros((batch, width), dtype=torch.long)
    for c in range(width):  # width = tree depth, a handful
        ok = (depth[:, c] - last >= min_blocks) & (levels < max_levels)
        keep[:, c], start[:, c] = ok, last
        last = torch.where(ok, depth[:, c], last)
        levels += ok
    cb, ck = torch.nonzero(keep, as_tuple=True)
    if cb.numel() == 0:
        return PrefixGroups.empty(batch)
    lvl = torch.arange(cb.shape[0]) - (torch.cumsum(levels, 0) - levels)[cb]
    _, g = torch.unique(nodes[cb, ck], return_inverse=True)
    order = torch.argsort(g * batch + cb)
    sizes = torch.bincount(g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes, 0)])
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.shape[0])
    n_levels = int(levels.max())
    seq_slots = torch.full((batch, n_levels), -1, dtype=_I32)
    seq_slots[cb, lvl] = slot.to(_I32)
    first = order[cu[:-1]]
    rep, g_start = cb[first], start[cb[first], ck[first]]
    nblk = depth[cb[first], ck[first]] - g_start
    span = int(nblk.max())
    cols = torch.arange(span)[None, :]
    g_tab = tables[rep[:, None], (g_start[:, None] + cols).clamp(max=tables.shape[1] - 1)]
    g_tab = torch.where(cols < nblk[:, None], g_tab, 0).to(_I32)
    g_lens = nblk * block_size
    return PrefixGroups(
        block_tables=g_tab, shared_lens=g_lens.to(_I32), cu_members=cu.to(_I32),
        members=cb[order].to(_I32), seq_slots=seq_slots,
        private_start=(last * block_size).to(_I32), max_members=int(sizes.max()),
        max_shared_len=int(g_lens.max()), saved_tokens=int(((sizes - 1) * g_lens).sum()))


def _finish(groups, device):
    return groups if device is None else groups.to(device, non_blocking=True)
