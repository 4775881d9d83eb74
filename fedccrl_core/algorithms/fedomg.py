"""FedOMG (Nguyen, Nguyen, Park, Pham, Hwang, ICLR 2025, "Federated Domain Generalization with Data-free
On-server Matching Gradient", arXiv 2501.14653; code github.com/skydvn/FedOMG). Server side only: the clients
train as FedAvg's (fedomg) or FedCCRL's (fedccrl_omg, our combination, not a published method).

Round t, after the clients u = 1..U have trained from the global theta:
  client update   Delta_u = theta_u - theta,   g_u = -Delta_u,   p_u = n_u / sum_v n_v
  FedAvg          g_FL = sum_u p_u g_u
  Eq. 15          Gamma* = argmin over the simplex (Gamma_u >= 0, sum_u Gamma_u = 1) of
                      F(Gamma) = Gamma_g . g_FL + kappa ||g_FL|| ||Gamma_g||,   Gamma_g = sum_u Gamma_u g_u
                  searched by `search_steps` momentum steps on the logits w, Gamma = softmax(w)
  Eq. 16          g_IGD = g_FL + kappa ||g_FL|| / ||Gamma*_g|| . Gamma*_g
  Eq. 17          theta <- theta - eta_g g_IGD
kappa = 0 and eta_g = 1 is FedAvg (Eq. 2), bit for bit here.

Vectorized: the U flattened updates are the rows of D [U, P] (kept in the weights' float32 as the replies arrive, on
the device that holds them; read in float64 column blocks of CHUNK, so no U x P float64 copy is ever made).
Every quantity of Eq. 15 is a linear or quadratic form in the Gram matrix G = D D^T [U, U]:
  Gamma_g . g_FL = Gamma^T G p,   ||g_FL||^2 = p^T G p,   ||Gamma_g||^2 = Gamma^T G Gamma
(the signs of g_u = -Delta_u cancel in each), so the search runs on G alone, and g_IGD = -(p + c Gamma*)^T D with
c = kappa ||g_FL|| / ||Gamma*_g||: one pass over the parameters to build G, one to combine.

Readings (docs/algorithms/fedomg.md lists them with the official code's departures):
- The search runs on G / s^2, s = mean_u ||g_u|| (as the official code): Gamma* does not change (F is homogeneous
  in g), but search_lr = 25 acts on that scale. It starts from w = 0 (Gamma uniform) and returns the iterate of
  lowest F among the search_steps + 1 it visits (as the official code), so F(Gamma*) <= F(uniform).
- BatchNorm statistics (running_mean, running_var) are estimates, not directions: they take Eq. 2's average of the
  clients' (FedAvg's), outside Eq. 15-17; num_batches_tracked the largest count, as Eq. 2 does here. Every other
  floating-point entry of the state (the parameters) takes Eq. 17.
- No division of g_IGD by (1 + kappa^2) and the clients weighted by n_u in g_FL only (Gamma searched over the
  unweighted g_u), as the paper's Eq. 15-16; the official code does otherwise (docs/algorithms/fedomg.md).


Floor 2 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

import math

import torch

from fedccrl_core.algorithm_params.fedomg import FedCCRLOMGParams, FedOMGParams
from fedccrl_core.algorithms.fedavg import FedAvg
from fedccrl_core.algorithms.fedccrl import FedCCRL
from fedccrl_core.algorithms.local_bn import BN_STATISTICS
from fedccrl_core.learning.aggregation import WeightedSum


def is_matched(key: str, value: torch.Tensor) -> bool:
    """Does this state entry take Eq. 15-17? Floating-point entries but the BatchNorm statistics (Eq. 2 for those)."""
    return value.is_floating_point() and key.rsplit(".", 1)[-1] not in BN_STATISTICS


def matching_objective(gamma: torch.Tensor, gram: torch.Tensor, p: torch.Tensor, kappa: float) -> torch.Tensor:
    """Eq. 15's F(Gamma) = Gamma_g . g_FL + kappa ||g_FL|| ||Gamma_g|| from the Gram matrix G of the g_u
    (gamma: [..., U], one objective per row)."""
    g_fl_norm = torch.sqrt(torch.clamp(p @ gram @ p, min=0.0))
    gamma_g_norm = torch.sqrt(torch.clamp(((gamma @ gram) * gamma).sum(-1), min=0.0))
    return gamma @ (gram @ p) + kappa * g_fl_norm * gamma_g_norm


def search_coefficients(
    gram: torch.Tensor, p: torch.Tensor, kappa: float, lr: float, steps: int, momentum: float
) -> torch.Tensor:
    """Eq. 15: Gamma* on the simplex, by `steps` heavy-ball steps on the logits w of Gamma = softmax(w), from w = 0;
    the visited iterate of lowest F. Closed-form gradient: dF/dGamma = G p + kappa ||g_FL|| G Gamma / ||Gamma_g||,
    dF/dw = Gamma * (dF/dGamma - Gamma . dF/dGamma) (the softmax Jacobian)."""
    s2 = torch.diagonal(gram).sqrt().mean() ** 2  # s = mean_u ||g_u||: the search's scale (F is homogeneous in g)
    if not s2 > 0:
        return torch.full_like(p, 1.0 / len(p))
    gram = gram / s2
    g_p = gram @ p
    g_fl_norm = float(torch.sqrt(torch.clamp(p @ g_p, min=0.0)))
    w = torch.zeros_like(p)
    buf = torch.zeros_like(p)
    best_f, best_gamma = math.inf, None
    for step in range(steps + 1):
        gamma = torch.softmax(w, 0)
        g_gamma = gram @ gamma
        gamma_g_norm = torch.sqrt(torch.clamp(gamma @ g_gamma, min=0.0))
        f = float(gamma @ g_p + kappa * g_fl_norm * gamma_g_norm)
        if f < best_f:
            best_f, best_gamma = f, gamma
        if step == steps:
            break
        d_gamma = g_p + (kappa * g_fl_norm / gamma_g_norm * g_gamma if gamma_g_norm > 0 else 0.0)
        grad = gamma * (d_gamma - gamma @ d_gamma)
        buf = momentum * buf + grad  # torch.optim.SGD's momentum form
        w = w - lr * buf
    assert best_gamma is not None, "FedOMG: the coefficient search met no finite objective (a non-finite update?)"
    return best_gamma


CHUNK = 1 << 16  # columns of D per block: a U x CHUNK float64 buffer, reused (63 MB at U = 120)


def column_blocks(rows: list[torch.Tensor]):
    """D = stack(rows) in float64, one block of CHUNK columns at a time: (start, block [U, width]). The buffer is
    reused, so the U x P float64 matrix is never allocated (on the CPU, first-touching it cost more than G)."""
    size = rows[0].numel()
    buf = torch.empty(len(rows), min(CHUNK, size), dtype=torch.float64, device=rows[0].device)
    for start in range(0, size, CHUNK):
        block = buf[:, : min(CHUNK, size - start)]
        for u, row in enumerate(rows):
            block[u].copy_(row[start : start + block.shape[1]])
        yield start, block


def gram_matrix(rows: list[torch.Tensor]) -> torch.Tensor:
    """G = D D^T [U, U] in float64."""
    gram = torch.zeros(len(rows), len(rows), dtype=torch.float64, device=rows[0].device)
    for _, block in column_blocks(rows):
        gram += block @ block.T
    return gram


def combine(rows: list[torch.Tensor], coefficients: torch.Tensor) -> torch.Tensor:
    """sum_u coefficients_u D_u [P] in float64."""
    out = torch.empty(rows[0].numel(), dtype=torch.float64, device=rows[0].device)
    coefficients = coefficients.to(out.device, torch.float64)
    for start, block in column_blocks(rows):
        out[start : start + block.shape[1]] = coefficients @ block
    return out


class MatchingGradientAggregation:
    """One round of Eq. 15-17, fed one reply at a time: each reply's update Delta_u = theta_u - theta is flattened
    into a row in the weights' precision on the reply's device, and Eq. 2 is streamed beside it (FedAvg's average: the BN statistics,
    and the exact kappa = 0, eta_g = 1 case)."""

    def __init__(self, alg: OnServerMatchingGradient, global_weights: dict, total: float | None = None):
        self.alg, self.global_weights = alg, global_weights
        self.fedavg = WeightedSum(total)  # Eq. 2
        self.keys = [k for k, v in global_weights.items() if is_matched(k, v)]
        self.theta: torch.Tensor | None = None  # theta flattened, on the first reply's device
        self.rows: list[torch.Tensor] = []  # Delta_u flattened, the rows of D
        self.n: list[float] = []
        self.client_ids: list[str] = []
        self.last: dict | None = None  # Gamma*, c, p of the last result(), for tests and inspection

    @staticmethod
    def flatten(state: dict, keys: list[str], like: torch.Tensor) -> torch.Tensor:
        return torch.cat([state[k].to(like.device, like.dtype).reshape(-1) for k in keys])

    def add(self, reply) -> None:
        self.fedavg.add(reply.weights, reply.n)
        if self.keys:
            if self.theta is None:
                self.theta = self.flatten(self.global_weights, self.keys, reply.weights[self.keys[0]])
            # Delta_u in the weights' precision (exact where theta_u is within a factor 2 of theta, Sterbenz)
            self.rows.append(self.flatten(reply.weights, self.keys, self.theta).sub_(self.theta))
        self.n.append(float(reply.n))
        self.client_ids.append(reply.client_id)

    def result(self) -> dict:
        averaged = self.fedavg.result()  # Eq. 2: theta_FL = theta + sum_u p_u Delta_u
        hp = self.alg.hp
        kappa, eta = hp.kappa, hp.global_lr
        if not self.keys:
            return averaged
        n = torch.tensor(self.n, dtype=torch.float64)
        p = n / n.sum()
        c, gamma = 0.0, None  # gamma: Gamma*, searched when kappa > 0
        if kappa > 0:
            gram = gram_matrix(self.rows).cpu()  # G [U, U]: one pass over D; the search runs on the host
            gamma = search_coefficients(gram, p, kappa, hp.search_lr, hp.search_steps, hp.search_momentum)
            gamma_g_norm = math.sqrt(max(float(gamma @ gram @ gamma), 0.0))
            g_fl_norm = math.sqrt(max(float(p @ gram @ p), 0.0))
            c = kappa * g_fl_norm / gamma_g_norm if gamma_g_norm > 0 else 0.0  # Eq. 16
        self.last = {"gamma": gamma, "c": c, "p": p, "client_ids": list(self.client_ids)}
        # Eq. 17: theta - eta_g g_IGD = theta + eta_g (sum_u p_u Delta_u + c Gamma*_g-direction), written from
        # theta_FL (Eq. 2's bits) so that kappa = 0, eta_g = 1 adds exact zeros to FedAvg's result.
        extra = (
            None if c == 0.0 or gamma is None else combine(self.rows, gamma * (eta * c))
        )  # -eta_g c Gamma*_g: one pass over D
        self.rows = []
        out, offset = dict(averaged), 0
        for k in self.keys:
            fl = averaged[k].to(torch.float64)
            new = fl + (eta - 1.0) * (fl - self.global_weights[k].to(fl.device, torch.float64))
            size = fl.numel()
            if extra is not None:
                new = new + extra[offset : offset + size].view_as(fl)
            out[k] = new.to(averaged[k].dtype)
            offset += size
        return out


class OnServerMatchingGradient:
    """FedOMG's server half (Eq. 15-17), mixed into an algorithm whose clients it leaves as they are."""

    hp: FedOMGParams  # of the Algorithm it is mixed into (FedOMG, FedCCRLOMG)

    def aggregation(self, global_weights, total=None):
        return MatchingGradientAggregation(self, global_weights, total)

    def aggregate(self, global_weights, replies):
        """Eq. 15-17 over a list of replies: the same computation as the streamed form."""
        agg = MatchingGradientAggregation(self, global_weights, float(sum(r.n for r in replies)))
        for r in replies:
            agg.add(r)
        return agg.result()


class FedOMG(OnServerMatchingGradient, FedAvg):
    """FedAvg's clients (cross-entropy), FedOMG's server step: the paper's FedOMG on FedAvg."""

    name = "fedomg"
    Params = FedOMGParams
    hp: FedOMGParams


class FedCCRLOMG(OnServerMatchingGradient, FedCCRL):
    """FedCCRL's clients (Algorithm 1 lines 3-22, every train.fedccrl key), FedOMG's server step in place of Eq. 2.
    Our combination: the two papers call their methods orthogonal; nobody has published this pairing."""

    name = "fedccrl_omg"
    Params = FedCCRLOMGParams
    hp: FedCCRLOMGParams
