"""Re-export: what one client holds lives on floor 1 (fedccrl_core/client.py), below the algorithms."""
from fedccrl_core.client import ClientData, ClientState

__all__ = ["ClientData", "ClientState"]
