"""FedDG-Bench's domain-heterogeneity partition (Bai et al., ICLR 2024, "Benchmarking algorithms for
federated domain generalization"; its `iid` parameter, here `lam`): C clients over D domains.

C >= D (the benchmark's rule, `NonIIDSplitter.split` in src/splitter.py of inouye-lab/FedDG_Benchmark):
- each non-empty domain gets one *main* client; each further client goes to the domain with the most
  examples per main client, argmax_d n_d / m_d (ties: the lower domain index);
- client c with main domain d(c) receives, of each domain d,
      n_d * [ (1 - lam) * 1{d = d(c)} / m_d  +  lam / C ]
  examples, m_d = the number of clients whose main domain is d.
  lam = 1: every client holds the same domain mix; lam = 0: each client holds only its main domain.

C < D (the benchmark's other branch, same file): domains in decreasing size are each given whole to the
client with the fewest examples so far (ties: the lower client index): the lam = 0 counts G[c, d]; the
lam = 1 counts are n_d / C; the counts are lam * n_d / C + (1 - lam) * G[c, d].

Rounding (a departure): the benchmark floors the counts and gives each domain's remainder to clients
0, 1, ... in order, so at lam = 0 a client can receive a stray example of a domain that is not its own.
Here each domain's remainder goes to the clients with the largest fractional parts (ties: the lower
client index), so lam = 0 gives single-domain clients exactly and every count is within one example of
the formula. The examples themselves are dealt as in the benchmark: each domain's examples are shuffled
and clients take consecutive runs in client order.

Label skew (`partition.dirichlet_alpha` = a > 0; this project's extension: FedDG-Bench's `NonIIDSplitter`
has no label axis, its heterogeneity is across domains only). The per-(client, domain) counts G[c, d] above
stay exactly as they are; only WHICH classes a client receives of each domain changes. Each client draws
one class preference q_c ~ Dirichlet(a * 1_K) (the per_domain scheme's convention, splits.py). For domain d
with class sizes n_{d,k}, the real-valued class counts X[c, k] are the matrix nearest in the
iterative-proportional-fitting sense to G[c, d] * q_c[k] whose row sums are G[c, d] and column sums n_{d,k}:

    X = diag(u) (G[:, d] q^T) diag(v),  sum_k X[c, k] = G[c, d],  sum_c X[c, k] = n_{d,k}     (Sinkhorn)

rounded to integers with both sums exact (each class column by largest remainder, then single examples
of a class moved from a client with too many to one with too few, the largest overshoot first). Small a:
each client sees few classes of a domain; a -> infinity: every client gets the domain's class mix.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import numpy as np

from fedccrl_core.foundation.errors import DataError


def _sizes(domain_sizes) -> np.ndarray:
    """The domain sizes n_d as an array, refused unless non-negative with some data (they come from the raw images;
    C = partition.num_clients >= 1 and lambda in [0, 1] are params.yaml's schema's)."""
    n = np.asarray(domain_sizes, dtype=np.int64)
    if n.ndim != 1 or n.size == 0 or (n < 0).any() or n.sum() == 0:
        raise DataError(f"partition: domain sizes must be non-negative with some data, got {list(n)}")
    return n


def main_domains(domain_sizes, num_clients: int) -> np.ndarray:
    """d(c) for each client c (C >= number of non-empty domains): one main client per domain, then argmax n_d/m_d."""
    n = _sizes(domain_sizes)
    if num_clients < int((n > 0).sum()):
        raise DataError(f"partition: {num_clients} clients < {int((n > 0).sum())} domains has no main domains")
    m = (n > 0).astype(np.int64)
    while m.sum() < num_clients:
        ratio = np.where(m > 0, n / np.maximum(m, 1), 0.0)
        m[int(np.argmax(ratio))] += 1
    return np.repeat(np.arange(n.size), m)


def expected_counts(domain_sizes, num_clients: int, lam: float) -> np.ndarray:
    """The real-valued counts [C, D] of the formula in the module docstring (before rounding)."""
    n = _sizes(domain_sizes).astype(float)
    C, D = num_clients, n.size
    if C >= int((n > 0).sum()):
        d_of = main_domains(domain_sizes, C)
        m = np.bincount(d_of, minlength=D).astype(float)
        onehot = np.zeros((C, D))
        onehot[np.arange(C), d_of] = 1.0
        single = onehot * np.divide(n, m, out=np.zeros(D), where=m > 0)
    else:
        single = np.zeros((C, D))
        for d in sorted(range(D), key=lambda d: (-n[d], d)):
            single[int(np.argmin(single.sum(axis=1))), d] = n[d]
    return (1.0 - lam) * single + lam * np.broadcast_to(n / C, (C, D))


def client_counts(domain_sizes, num_clients: int, lam: float) -> np.ndarray:
    """Integer counts [C, D]: floors of `expected_counts`, each domain's remainder to the largest fractions."""
    n = _sizes(domain_sizes)
    real = expected_counts(n, num_clients, lam)
    counts = np.floor(real + 1e-9).astype(np.int64)  # 1e-9: 2.9999999 from float error is 3
    for d in range(n.size):
        short = int(n[d] - counts[:, d].sum())
        frac = real[:, d] - counts[:, d]
        order = sorted(range(num_clients), key=lambda c: (-frac[c], c))
        counts[order[:short], d] += 1
    return counts


def assign(
    domain_of: np.ndarray,
    num_domains: int,
    num_clients: int,
    lam: float,
    rng: np.random.Generator,
    labels: np.ndarray | None = None,
    dirichlet_alpha: float | None = None,
) -> list[np.ndarray]:
    """Indices (into `domain_of`, an example -> domain index array) of each client; every example exactly once.
    With `dirichlet_alpha` (and `labels`), each domain's share of a client follows its class preference
    (module docstring, "Label skew"); without, the benchmark's dealing."""
    domain_of = np.asarray(domain_of)
    sizes = np.bincount(domain_of, minlength=num_domains)
    counts = client_counts(sizes, num_clients, lam)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    if dirichlet_alpha is None:
        for d in range(num_domains):
            idx = rng.permutation(np.flatnonzero(domain_of == d))
            for c, chunk in enumerate(np.split(idx, np.cumsum(counts[:, d])[:-1])):
                parts[c].append(chunk)
        return [np.sort(np.concatenate(p)) for p in parts]
    labels = np.asarray(labels)
    classes = np.unique(labels)
    q = rng.dirichlet(np.full(classes.size, float(dirichlet_alpha)), size=num_clients)  # q_c, one per client
    for d in range(num_domains):
        in_d = domain_of == d
        n_dk = np.array([int((in_d & (labels == k)).sum()) for k in classes])
        x = class_counts(counts[:, d], n_dk, q)
        for j, k in enumerate(classes):
            idx = rng.permutation(np.flatnonzero(in_d & (labels == k)))
            for c, chunk in enumerate(np.split(idx, np.cumsum(x[:, j])[:-1])):
                parts[c].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def class_counts(rows: np.ndarray, cols: np.ndarray, q: np.ndarray, iters: int = 500) -> np.ndarray:
    """Integer X [C, K] >= 0 with row sums `rows` (a domain's G[:, d]) and column sums `cols` (its class sizes),
    proportional to rows[c] * q[c, k] after Sinkhorn scaling; module docstring, "Label skew"."""
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    if rows.sum() != cols.sum():
        raise ValueError(f"class_counts: row total {rows.sum()} != column total {cols.sum()}")
    x = rows[:, None] * np.maximum(q, 1e-12)  # q > 0 keeps every cell reachable, so Sinkhorn converges
    for _ in range(iters):
        x *= np.divide(cols, x.sum(0), out=np.zeros(cols.size), where=x.sum(0) > 0)[None, :]
        x *= np.divide(rows, x.sum(1), out=np.zeros(rows.size), where=x.sum(1) > 0)[:, None]
        if np.abs(x.sum(0) - cols).max() < 1e-6:
            break
    out = np.floor(x + 1e-9).astype(np.int64)
    for k in range(cols.size):  # exact columns: largest remainder (ties: lower client)
        short = int(cols[k] - out[:, k].sum())
        order = sorted(range(rows.size), key=lambda c: (-(x[c, k] - out[c, k]), c))
        out[order[:short], k] += 1
    while True:  # exact rows: move one example of a class from over to under
        gap = out.sum(1) - rows
        if not gap.any():
            return out
        a, b = int(np.argmax(gap)), int(np.argmin(gap))
        over = np.where(out[a] > 0, out[a] - x[a], -np.inf)
        k = int(np.argmax(over))
        out[a, k] -= 1
        out[b, k] += 1
