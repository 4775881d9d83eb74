"""Differential privacy for FedCCRL's two upload channels (floor 1, docs/architecture.md "Layers").

settings.py    params.yaml `train.privacy.*`, typed (no torch, no dp_accounting)
noise.py       where the noise and the privacy samples come from: the OS's entropy, never the run seed
dp.py          the mechanisms: clipped + noised statistics rows (Eq. 6-8's upload), client-level DP-FedAvg
               (McMahan et al., ICLR 2018) on the weights (Eq. 2's aggregate)
accountant.py  both channels composed over the rounds with dp_accounting's RDP accountant
charged.py     the statistics release a round's pre-round check charged: no client's release may exceed its ratio
canary_audit.py  `fedccrl audit`: canaries, attacks and the epsilon lower bound of the statistics release
audit.py       the membership measurement of real images (scripts/privacy_audit.py)
"""
