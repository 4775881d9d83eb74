"""What the pre-round check under train.privacy.max_epsilon charged for a round's statistics release
(federation/round_privacy.py Private.before_round), as the bound a client checks its own release against before it
draws a row of Eq. 8.

The round's statistics event is the sampled Gaussian of the client with the largest sampling ratio k_i / n_i
(accountant.py worst_client: an image belongs to one client), and the RDP of a sampled Gaussian without replacement
(Wang, Balle, Kasiviswanathan, AISTATS 2019, Thm. 27, as dp_accounting computes it) depends on the ratio alone and
grows with it. So k of n rows with k / n at most the charged ratio spend no more than the check charged, whichever
client releases them; a larger ratio could take epsilon past max_epsilon. The check reads the n_i each client
announced before the round, and a client's n_i can change between rounds (a site's image folder did).
No torch, no dp_accounting: a site checks its release with it.


Floor 1 of fedccrl_core (docs/architecture.md, "Layers")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChargedRelease:
    """The (n, k) whose ratio k / n the pre-round check charged for the round's statistics release (Eq. 8's k_i of
    n_i): a client releases k' of n' rows only when k' / n' <= k / n."""

    n: int
    k: int

    def __post_init__(self):
        if not 0 < self.k <= self.n:
            raise ValueError(f"a charged release of k = {self.k!r} rows out of n = {self.n!r}: needs 0 < k <= n")

    def covers(self, n: int, k: int) -> bool:
        """Whether k of n rows sample at a ratio no larger than the charged one (in integers: exact)."""
        return k * self.n <= self.k * n

    def refusal(self, n: int, k: int) -> str:
        """Why a client releasing k of its n rows must not ("" when the charge covers it): the charged and the
        actual (n, k), each with its ratio."""
        if self.covers(n, k):
            return ""
        return (
            f"releasing k = {k} of its n = {n} rows (ratio {k / n:.4f}) exceeds the k = {self.k} of n = {self.n} "
            f"(ratio {self.k / self.n:.4f}) that the pre-round check charged (train.privacy.max_epsilon); "
            "refused before any row was drawn"
        )
