"""DLCP studies: the host-transport evaluation, in-network incast and marking, accuracy under loss."""
