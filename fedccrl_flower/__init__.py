"""Flower (1.42, Message API) engine for fedccrl_core: a ServerApp and a ClientApp that move the
payloads of any fedccrl_core algorithm, plus launchers for simulation and deployment (run.py).

One algorithm, one implementation: the apps call `Algorithm.client_upload`, `server_payloads`,
`local_train` and `aggregate` exactly as the in-process engine does, with the same seeds.
"""

from fedccrl_core.foundation.threads import apply_thread_policy

apply_thread_policy()  # a SuperNode's ClientApp trains with torch: no OpenMP spin-wait (fedccrl_core/foundation/threads.py)
