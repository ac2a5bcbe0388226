"""DLCP host side: marking policy, bounded-loss transport, rate control, evaluation."""
from host.dlcp.marking import DlcpPolicy, layer_band, layer_dscp

__all__ = ["DlcpPolicy", "layer_band", "layer_dscp"]
