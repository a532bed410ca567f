"""Near duplicates (MinHash, then exact Jaccard) and the collapse guard's readings and verdicts over a dataset's text.

Used by prepare_data in the training Python; numpy is the only library it needs. The bounds come from the
dataset-curation skill's collapse table, passed in by the caller.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from finetune_mcp.common import records as R


def near_duplicates(texts: list[str], mh: dict, seed: int = 0) -> tuple[list[int | None], int]:
    """For each record the index of an earlier near copy (MinHash Jaccard >= mh["jaccard"]) or None.
    Returns (match, candidate_pairs_checked)."""
    import numpy as np

    n = len(texts)
    if n == 0:
        return [], 0
    sh = _shingles(texts, mh["shingle_words"])
    sig = _minhash_signatures(sh, mh["num_perm"], seed)
    lo, hi = _band_candidates(sig, mh["bands"], sh.empty)
    match: list[int | None] = [None] * n
    if lo is None:
        return match, 0
    hit = _exact_jaccard_hits(sh, sig, lo, hi, mh["jaccard"])
    best = np.full(n, n, dtype=np.int64)
    np.minimum.at(best, hi[hit], lo[hit])
    for j in np.flatnonzero(best < n):
        match[int(j)] = int(best[j])
    return match, int(len(lo))


@dataclass
class _Shingles:
    """Each record's k-word shingles hashed to 32 bits, flat: x[off[i]:off[i] + count] belong to record i."""

    x: Any
    rec_of: Any
    off: Any
    empty: Any


def _shingles(texts: list[str], k: int) -> _Shingles:
    import numpy as np

    n = len(texts)
    # Words become ids, shingles k consecutive ids mixed into 32 bits, all in numpy; a record shorter than
    # k words is one shingle of what it has. Ids are assigned in first-seen order, so this is deterministic.
    vocab: dict[str, int] = {}
    ids: list[int] = []
    lens = np.zeros(n, dtype=np.int64)
    for i, t in enumerate(texts):
        w = R.words(t)
        lens[i] = len(w)
        for x in w:
            if x not in vocab:
                vocab[x] = len(vocab) + 1
        ids.extend(map(vocab.__getitem__, w))
    empty = lens == 0
    wid = np.asarray(ids, dtype=np.uint64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    nsh = np.where(lens >= k, lens - k + 1, 1)
    nsh[empty] = 1
    off = np.concatenate(([0], np.cumsum(nsh)[:-1])).astype(np.int64)
    rec_of = np.repeat(np.arange(n), nsh)
    pos = np.arange(int(nsh.sum())) - np.repeat(off, nsh) + np.repeat(starts, nsh)
    mult = (np.uint64(0x9E3779B1), np.uint64(0x85EBCA77), np.uint64(0xC2B2AE3D))
    x = np.zeros(len(pos), dtype=np.uint64)
    for d in range(k):
        p_d = pos + d
        inside = p_d < np.repeat(starts + lens, nsh)
        v = np.where(inside, wid[np.minimum(p_d, max(len(wid) - 1, 0))] if len(wid) else 0, 0).astype(np.uint64)
        x = (x * mult[d % 3] + v + np.uint64(d + 1)) & np.uint64(0xFFFFFFFF)
    x[empty[rec_of]] = (np.uint64(0xFFFFFFFF) - rec_of[empty[rec_of]].astype(np.uint64)) & np.uint64(0xFFFFFFFF)
    return _Shingles(x, rec_of, off, empty)


def _minhash_signatures(sh: _Shingles, perm: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed + 7919)
    # Multiply-shift hashing (a odd): (a*x + b) mod 2**64, top 32 bits; one independent hash per permutation.
    a = rng.integers(0, 2**63 - 1, size=perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63 - 1, size=perm, dtype=np.uint64)
    sig = np.empty((perm, len(sh.off)), dtype=np.uint32)
    step = 8
    for s0 in range(0, perm, step):
        vals = ((a[s0:s0 + step, None] * sh.x[None, :] + b[s0:s0 + step, None]) >> np.uint64(32)).astype(np.uint32)
        sig[s0:s0 + step] = np.minimum.reduceat(vals, sh.off, axis=1)
    return sig


def _band_candidates(sig, bands: int, empty):
    """Pairs (lo < hi) of records that share all rows of some band, each pair once; (None, None) when there are none."""
    import numpy as np

    perm, n = sig.shape
    rows = perm // bands
    # Within a bucket each record is compared with the (up to 16) records before it, so a huge bucket (a
    # collapsed set) stays cheap.
    ii, jj = [], []
    for bi in range(bands):
        block = np.ascontiguousarray(sig[bi * rows:(bi + 1) * rows].T)
        keys = block.view(np.dtype((np.void, block.dtype.itemsize * rows))).ravel()
        _, inv = np.unique(keys, return_inverse=True)
        order = np.argsort(inv, kind="stable")
        sinv = inv[order]
        first = np.r_[True, sinv[1:] != sinv[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
        pos = np.arange(n) - start
        for d in range(1, 17):
            ok = pos >= d
            if not ok.any():
                break
            ii.append(order[np.flatnonzero(ok) - d])
            jj.append(order[ok])
    if not ii:
        return None, None
    i_all = np.concatenate(ii)
    j_all = np.concatenate(jj)
    lo, hi = np.minimum(i_all, j_all), np.maximum(i_all, j_all)
    # Sort and drop repeats (np.unique's hash path is ~100x slower than a sort on millions of int64).
    pair = np.sort(lo.astype(np.int64) * n + hi)
    pair = pair[np.r_[True, pair[1:] != pair[:-1]]]
    lo, hi = pair // n, pair % n
    keep = ~(empty[lo] | empty[hi])
    return lo[keep], hi[keep]


def _exact_jaccard_hits(sh: _Shingles, sig, lo, hi, thr: float):
    """Which candidate pairs are near copies. The MinHash estimate only shortlists; the exact Jaccard of the
    shingle sets decides, so estimation noise on thousands of pairs cannot invent near copies."""
    import numpy as np

    n = sig.shape[1]
    sim = np.empty(len(lo))
    for c0 in range(0, len(lo), 65536):
        sim[c0:c0 + 65536] = (sig[:, lo[c0:c0 + 65536]] == sig[:, hi[c0:c0 + 65536]]).mean(axis=0)
    cand = np.flatnonzero(sim >= thr - 0.2)
    hit = np.zeros(len(lo), dtype=bool)
    if not len(cand):
        return hit
    # All shortlisted pairs at once: each record's distinct shingles (sorted), both sides of a pair tagged with
    # the pair's number; a shingle in both sides shows up twice in a row.
    uniq = np.lexsort((sh.x, sh.rec_of))
    xs, rs = sh.x[uniq], sh.rec_of[uniq]
    first = np.r_[True, (xs[1:] != xs[:-1]) | (rs[1:] != rs[:-1])]
    xs, rs = xs[first], rs[first]
    size = np.bincount(rs, minlength=n)
    begin = np.concatenate(([0], np.cumsum(size)[:-1]))
    for c0 in range(0, len(cand), 50_000):
        cc = cand[c0:c0 + 50_000]
        a_rec, b_rec = lo[cc], hi[cc]
        both = np.concatenate((a_rec, b_rec))
        cnt = size[both]
        tag = np.repeat(np.arange(len(both)) % len(cc), cnt).astype(np.uint64)
        at = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt) + np.repeat(begin[both], cnt)
        key = np.sort((tag << np.uint64(32)) | xs[at])
        dup = np.flatnonzero(key[1:] == key[:-1])
        inter = np.bincount((key[dup] >> np.uint64(32)).astype(np.int64), minlength=len(cc))
        union = size[a_rec] + size[b_rec] - inter
        hit[cc] = inter >= thr * union
    return hit


def collapse_metrics(trained: list[str], near_share: float, table: dict, seed: int) -> dict:
    """The collapse guard's readings over the trained text of each record (see the skill's collapse table)."""
    import random

    tw = [R.words(t) for t in trained]
    order = list(range(len(tw)))
    random.Random(f"collapse:{seed}").shuffle(order)
    uni, bi = [], []
    budget = table["sample_words"]
    for i in order:
        w = tw[i]
        if not w:
            continue
        take = w[:budget - len(uni)]
        uni += take
        bi += list(zip(take, take[1:]))
        if len(uni) >= budget:
            break
    lengths = [len(w) for w in tw]
    mean = statistics.fmean(lengths) if lengths else 0.0
    cv = (statistics.pstdev(lengths) / mean) if mean > 0 else 0.0
    k = table["opening_words"]
    opening = [" ".join(w[:k]) if w else None for w in tw]
    counts = Counter(o for o in opening if o is not None)
    top, top_n = (counts.most_common(1)[0] if counts else ("", 0))
    return {
        "distinct-1": round(len(set(uni)) / len(uni), 4) if uni else 0.0,
        "distinct-2": round(len(set(bi)) / len(bi), 4) if bi else 0.0,
        "near-duplicate-share": round(near_share, 4),
        "length-cv": round(cv, 4),
        "top-opening-share": round(top_n / max(sum(counts.values()), 1), 4),
        "_top_opening": top,
        "_top_records": [i for i, o in enumerate(opening) if top and o == top][:5],
        "_sample_words": len(uni),
        "_mean_words": round(mean, 2),
    }


def shared_phrase(texts: list[str], seed: int = 0, max_n: int = 12, sample: int = 1000, head: int = 64) -> tuple[str, float]:
    """(phrase as written, share of texts holding it): the longest word n-gram that nearly as many texts hold as hold
    the most shared word pair. Counted on a fixed sample of texts (their first `head` words); the share is exact."""
    import random
    import re

    order = list(range(len(texts)))
    random.Random(f"phrase:{seed}").shuffle(order)
    tw = [R.words(texts[i])[:head] for i in order[:sample]]
    best: dict[int, tuple[tuple, int]] = {}
    for n in range(2, max_n + 1):
        df: dict[tuple, int] = {}  # insertion order = first seen, which breaks ties the same way on every run
        for w in tw:
            for g in dict.fromkeys(tuple(w[j:j + n]) for j in range(len(w) - n + 1)):
                df[g] = df.get(g, 0) + 1
        if not df:
            break
        top = max(df.values())
        best[n] = next((g, c) for g, c in df.items() if c == top)
    if not best:
        return "", 0.0
    n = max(k for k, (_, c) in best.items() if c >= 0.8 * best[2][1])
    pat = re.compile(r"(?<!\w)" + r"\W+".join(map(re.escape, best[n][0])) + r"(?!\w)", re.I)
    hits = [m for m in map(pat.search, texts) if m]
    return (hits[0].group(0) if hits else " ".join(best[n][0])), len(hits) / max(len(texts), 1)


def what_repeats(trained: list[str], values: dict, near_example: str | None, seed: int) -> dict[str, str]:
    """Per collapse metric, the words that say what repeats (the phrase, the opening, a near-copy pair, the length)."""
    phrase, share = shared_phrase(trained, seed)
    said = f"{share:.0%} of answers share the phrase {phrase!r}" if phrase else "the answers share no phrase"
    sd = values["length-cv"] * values["_mean_words"]
    return {
        "distinct-1": said, "distinct-2": said,
        "near-duplicate-share": f"{values['near-duplicate-share']:.0%} of records are near copies of an earlier one"
        + (f" (e.g. {near_example})" if near_example else ""),
        "length-cv": f"answers run {values['_mean_words']:.0f} ± {sd:.1f} words",
        "top-opening-share": f"{values['top-opening-share']:.0%} of answers open with {values['_top_opening']!r} (e.g. {values.get('_top_where')})",
    }


UNSTATED = ("neither the brief nor the data says where the records came from, so the guard treats them as {}: if people wrote "
            "or chose them on purpose, add `provenance: curated` to the brief's ## Dataset Expectation")


def judge_collapse(values: dict, table: dict, n_records: int, sink: R.Sink, provenance: str = "synthetic",
                   repeats: dict[str, str] | None = None, stated: bool = True) -> dict:
    """Verdict per metric. A fail bound breached by curated data (the collapse table's provenance rules) is reported
    as a warning; every message names what repeats. stated: whether the brief or the data gave the provenance."""
    verdicts = {}
    gated = n_records < table["min_records"]
    rule = table["provenance"][provenance]
    for name, bounds in table["metrics"].items():
        v = values[name]
        verdict = "ok"
        msg = None
        if bounds.get("fail_below") is not None and v < bounds["fail_below"]:
            verdict, msg = "fail", f"{name} {v} is below {bounds['fail_below']}"
        elif bounds.get("fail_above") is not None and v > bounds["fail_above"]:
            verdict, msg = "fail", f"{name} {v} is above {bounds['fail_above']}"
        elif bounds.get("warn_below") is not None and v < bounds["warn_below"]:
            verdict, msg = "warn", f"{name} {v} is below {bounds['warn_below']}"
        elif bounds.get("warn_above") is not None and v > bounds["warn_above"]:
            verdict, msg = "warn", f"{name} {v} is above {bounds['warn_above']}"
        elif all(bounds.get(k) is None for k in ("fail_below", "fail_above", "warn_below", "warn_above")):
            verdict = "info"
        if msg and repeats and repeats.get(name):
            msg += f": {repeats[name]}"
        elif name == "top-opening-share" and msg:
            msg += f" (most common opening: {values['_top_opening']!r}, e.g. {values.get('_top_where')})"
        if verdict == "fail" and gated:
            verdict = "warn"
            msg += f"; not failing: fewer than {table['min_records']} records"
        elif verdict == "fail" and rule["on_fail"] == "warning":
            verdict = "warn"
            msg += f"; reported, not failing: the data is {provenance}"
        elif verdict == "fail" and not stated:
            msg += "; " + UNSTATED.format(provenance)
        verdicts[name] = verdict
        if verdict == "fail":
            sink.error(f"collapse-{name}", f"collapse guard: {msg}", field="trained text")
        elif verdict == "warn":
            sink.warn(f"collapse-{name}", f"collapse guard: {msg}", field="trained text")
    return verdicts
