"""The packer's working state: packs as a padded slot matrix with per-pack loads, and the vectorised
best single swap or move between pairs of packs (``omnibal.data.balance.packer`` runs its phases on it)."""

from __future__ import annotations

import numpy as np

_CHUNK_PAIRS = 1 << 14  # bounds the [pairs, K, K] temporaries to a few MiB each


class Packs:
    """Packs as a padded ``[P, K]`` slot matrix (``n`` = empty slot, a zero-size sentinel sample)."""

    def __init__(self, slots: np.ndarray, v: np.ndarray, t: np.ndarray, lc: np.ndarray) -> None:
        n = len(v)
        self.n = n
        self.slots = slots
        self.vv, self.tt, self.ll = np.append(v, 0.0), np.append(t, 0.0), np.append(lc, 0.0)
        self.pv = self.vv[slots].sum(1)
        self.pt = self.tt[slots].sum(1)
        self.pl = self.ll[slots].sum(1)

    def best_moves(self, a: np.ndarray, b: np.ndarray, objective, group: int = 1):
        """For every pair (a[k], b[k]) the best exchange that lowers ``objective(pv, pt, pl)`` of the
        pair: a single swap/move (``group=1``; moves go through an empty slot) or a swap of up to two
        samples against up to two (``group=2``). Returns (gain [h], slots sent by a [h, g], slots sent by
        b [h, g]); gain <= 0 means no improving exchange."""
        if len(a) == 0:  # no pair to try (e.g. no active pair in a pass): nothing to reduce over
            empty = np.zeros((0, group), np.int64)
            return np.zeros(0), empty, empty.copy()
        both = np.unique(np.concatenate([a, b]))
        # only the occupied slots plus one free one matter: compact the rows of these packs
        self.slots[both] = np.sort(self.slots[both], axis=1)  # the empty marker n sorts last
        width = min(self.slots.shape[1], int((self.slots[both] < self.n).sum(1).max()) + 1)
        if group == 1:
            sel = np.arange(width)[:, None]
        else:
            i1, i2 = np.triu_indices(width, 1)
            sel = np.stack([i1, i2], axis=1)  # pairs of slots; an empty slot in a pair makes it a single
        k = len(sel)
        h = len(a)
        gains = np.full(h, -np.inf)
        best_i = np.zeros((h, sel.shape[1]), np.int64)
        best_j = np.zeros((h, sel.shape[1]), np.int64)
        chunk = max(1, _CHUNK_PAIRS * 64 // (k * k))
        for c0 in range(0, h, chunk):
            ca, cb = a[c0:c0 + chunk], b[c0:c0 + chunk]
            sa, sb = self.slots[ca, :width], self.slots[cb, :width]
            ga, gb = sa[:, sel], sb[:, sel]  # [c, k, group] sample ids per candidate subset
            dv = self.vv[ga].sum(2)[:, :, None] - self.vv[gb].sum(2)[:, None, :]  # a sends minus receives
            dt = self.tt[ga].sum(2)[:, :, None] - self.tt[gb].sum(2)[:, None, :]
            dl = self.ll[ga].sum(2)[:, :, None] - self.ll[gb].sum(2)[:, None, :]
            before = objective(self.pv[ca], self.pt[ca], self.pl[ca]) + objective(self.pv[cb], self.pt[cb],
                                                                                  self.pl[cb])
            after = objective(self.pv[ca][:, None, None] - dv, self.pt[ca][:, None, None] - dt,
                              self.pl[ca][:, None, None] - dl)
            after += objective(self.pv[cb][:, None, None] + dv, self.pt[cb][:, None, None] + dt,
                               self.pl[cb][:, None, None] + dl)
            gain = before[:, None, None] - after
            gain[(ga == self.n).all(2)[:, :, None] & (gb == self.n).all(2)[:, None, :]] = -np.inf
            flat = gain.reshape(len(ca), k * k)
            best = np.argmax(flat, axis=1)
            g = flat[np.arange(len(ca)), best]
            gains[c0:c0 + chunk] = np.where(g > 1e-12 * np.maximum(before, 1e-300), g, -np.inf)
            best_i[c0:c0 + chunk] = sel[best // k]
            best_j[c0:c0 + chunk] = sel[best % k]
        return gains, best_i, best_j

    def apply(self, a: np.ndarray, b: np.ndarray, i: np.ndarray, j: np.ndarray) -> None:
        """Swap slots ``i`` of packs ``a`` with slots ``j`` of packs ``b`` (all packs distinct)."""
        x = self.slots[a[:, None], i]
        y = self.slots[b[:, None], j]
        self.slots[a[:, None], i], self.slots[b[:, None], j] = y, x
        for total, per in ((self.pv, self.vv), (self.pt, self.tt), (self.pl, self.ll)):
            d = per[x].sum(1) - per[y].sum(1)
            total[a] -= d
            total[b] += d

    def exchange(self, a: np.ndarray, b: np.ndarray, objective, group: int = 1) -> int:
        """Apply the best improving exchange of every disjoint pair (a[k], b[k]); returns pairs changed."""
        gains, i, j = self.best_moves(a, b, objective, group)
        take = gains > 0
        if take.any():
            self.apply(a[take], b[take], i[take], j[take])
        return int(take.sum())

    def pack_of(self) -> np.ndarray:
        p, width = self.slots.shape
        out = np.empty(self.n, dtype=np.int64)
        used = self.slots < self.n
        out[self.slots[used]] = np.broadcast_to(np.arange(p)[:, None], (p, width))[used]
        return out
